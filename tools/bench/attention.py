"""Attention backends on CPU: memory and step time of fused attention (`auto`) against unfused,
measured in one run beside the planner's activation memory for each.

    python tools/bench/attention.py [--seq 1024 2048] [--rounds 2] [--steps 4] [--warmup 1]

A one-rank plan of a small model (2 layers, hidden 256, 8 heads, FFN 1024, vocab 1024, fp32,
one micro-batch of one sequence, dropout 0) is trained at each sequence length with the plan's
`attention_backend` unfused (megatron-core's DotProductAttention) and auto (torch's
scaled_dot_product_attention: the fused CPU kernel), a fresh process per launch
(OMP_NUM_THREADS=1), alternating over --rounds rounds. Per case:
- activations: the peak bytes of tensors autograd saves for backward in one step (parameters
  excluded), against the planner's activation estimate for the plan (converted to fp32 as the
  fidelity bench does);
- peak memory: the process's peak resident set (libraries included), as the runtime reports it
  on CPU;
- step time: the fastest step after warm-up (the undisturbed cost) and the median.
On CPU, torch's fused kernel takes no attention dropout (it falls back to its math kernel, which
keeps the scores); the runs use dropout 0, as the equivalence tests do.
"""

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent), str(ROOT / "tests")]

MODEL = {
    "num_layers": 2,
    "hidden_size": 256,
    "ffn_hidden_size": 1024,
    "num_attention_heads": 8,
    "num_query_groups": 8,
    "vocab_size": 1024,
    "name": "bench-attention",
}
BACKENDS = ("unfused", "auto")


def train_rank(plan, iters):
    """One rank: `iters` steps, then one more with the saved-for-backward bytes tracked."""
    from fidelity import run_config, tracked_step
    from megatron_hexi.training import Trainer, init_distributed

    config = run_config(iters + 1, "cpu")
    device = init_distributed(plan, config)
    trainer = Trainer(plan, config, device)
    steps = [trainer.train_step(it)["step_time_s"] for it in range(iters)]
    _, activations = tracked_step(trainer, iters)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"step_s": steps, "activations": activations, "peak_rss": peak_rss}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=600)
    a = ap.parse_args(argv)
    import yaml

    import attention as this
    from fidelity import _cluster, report_load
    from harness import run_distributed
    from planner.models import load_model
    from planner.plan import build_plan
    from planner.simulator import simulate

    report_load()
    runs = {(seq, b): [] for seq in a.seq for b in BACKENDS}
    plans = {}
    with tempfile.TemporaryDirectory(prefix="hexi-attention-") as tmp:
        for seq in a.seq:
            path = Path(tmp) / f"model-{seq}.yaml"
            path.write_text(yaml.safe_dump({**MODEL, "seq_length": seq}))
            model = load_model(str(path))
            for backend in BACKENDS:
                pipelines = [
                    {
                        "micro_batch_size": 1,
                        "num_microbatches": 1,
                        "stages": [{"ranks": [0], "layers": [0, MODEL["num_layers"]]}],
                    }
                ]
                plans[seq, backend] = build_plan(
                    _cluster(1, None), model, 1, pipelines, attention_backend=backend
                )
        for rnd in range(a.rounds):
            for key, plan in plans.items():
                out = run_distributed(
                    this.train_rank,
                    1,
                    plan,
                    a.warmup + a.steps,
                    timeout=a.timeout,
                    fresh=True,  # fresh interpreters: threads fixed before torch is imported
                    env={"OMP_NUM_THREADS": "1"},
                )[0]
                runs[key].append(out)
                steps = out["step_s"][a.warmup :]
                print(
                    f"round {rnd + 1} seq {key[0]} {key[1]:>7}: steps (ms) "
                    f"{[round(s * 1e3, 1) for s in steps]}, activations "
                    f"{out['activations'] / 1e6:.1f} MB, peak RSS {out['peak_rss'] / 1e6:.0f} MB",
                    flush=True,
                )
    print(f"load average {os.getloadavg()[0]:.1f} after the run\n")
    print(
        "| seq | backend | activations MB (measured) | planner MB | error | peak RSS MB | "
        "fastest step ms | median step ms |"
    )
    print("|---|---|---|---|---|---|---|---|")
    fastest = {}
    for (seq, backend), outs in runs.items():
        steps = [s for o in outs for s in o["step_s"][a.warmup :]]
        fastest[seq, backend] = min(steps)
        acts = min(o["activations"] for o in outs)
        rss = min(o["peak_rss"] for o in outs)
        t = simulate(plans[seq, backend]).memory_terms_gb[0]
        # the planner's bf16 activations in fp32 (x2), plus its fp32 logits term
        pred = (t["activations"] * 2 + t["logits"]) * 1e9
        print(
            f"| {seq} | {backend} | {acts / 1e6:.1f} | {pred / 1e6:.1f} | "
            f"{(pred - acts) / acts:+.0%} | {rss / 1e6:.0f} | {min(steps) * 1e3:.1f} | "
            f"{statistics.median(steps) * 1e3:.1f} |"
        )
    print()
    for seq in a.seq:
        acts = {b: min(o["activations"] for o in runs[seq, b]) for b in BACKENDS}
        rss = {b: min(o["peak_rss"] for o in runs[seq, b]) for b in BACKENDS}
        print(
            f"seq {seq}: auto / unfused activations {acts['auto'] / acts['unfused']:.3f}, peak "
            f"RSS {rss['auto'] / rss['unfused']:.3f}, fastest step "
            f"{fastest[seq, 'auto'] / fastest[seq, 'unfused']:.3f}"
        )
    print(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}]")


if __name__ == "__main__":
    main()
