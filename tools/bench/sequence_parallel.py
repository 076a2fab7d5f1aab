"""Sequence parallelism on CPU: activation memory, peak memory and step time of a TP-2 stage with
the plan's `sequence_parallel` off and on, measured in one run beside the planner's activation
memory for each.

    python tools/bench/sequence_parallel.py [--seq 1024 2048] [--rounds 2] [--steps 4] [--warmup 1]

A one-stage plan over two ranks in tensor parallelism (TP 2, even shards) of a small model (2
layers, hidden 256, 8 heads, FFN 1024, vocab 1024, fp32, one micro-batch of one sequence,
dropout 0, attention backend auto: torch's fused kernel) is trained at each sequence length
with `training.sequence_parallel` off and on: two gloo processes per launch
(tests/harness.run_distributed, OMP_NUM_THREADS=1 in each before torch is imported), a fresh
launch per case, alternating over --rounds rounds so that a slow spell of the machine hits both.
Per case and rank:
- activations: the peak bytes of tensors autograd saves for backward in one step (parameters
  excluded), against the planner's activation estimate for that rank (`simulate(plan)`'s
  activations term, bf16, converted to fp32 (x2), plus its fp32 logits term, as the fidelity and
  attention benches compare them);
- peak memory: the process's peak resident set (libraries included), as the runtime reports it
  on CPU;
- step time: the fastest step after warm-up (the undisturbed cost) and the median; the runtime's
  `step_time_s`, the slower of the two ranks.
Then the on / off ratios of the three, measured in the same run, and the planner's on / off
activation ratio with its error against the measured one.

Why: under sequence parallelism (Korthikanti et al. 2022) a TP stage keeps its activations
outside attention and MLP (the norms' inputs, the residual stream, the dropout masks: the
replicated `10 sbh` of the `34 sbh` per layer) for its part of the sequence only, s/t positions
on each of its t ranks, and all-gathers / reduce-scatters the sequence around attention and MLP
instead of all-reducing. The planner divides that term by t (`memory.layer_activation_bytes`'s
`sequence_split`); this bench checks the saving against the runtime's bytes.

Checks: every rank of an "on" launch must run megatron-core's sequence parallelism (its
TransformerConfig's `sequence_parallel`), and no rank of an "off" launch; the two cases train
the same model on the same data, so their losses must agree (the maximum relative difference
over every step of every launch is printed; it should be ~1e-6 or less in fp32).
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
    "name": "bench-sequence-parallel",
}
TP = 2
VARIANTS = {"off": False, "on": True}
LOSS_TOLERANCE = 1e-5  # max relative difference of on / off losses (fp32, reordered sums)


def train_rank(plan, iters):
    """One rank: `iters` steps, then one more with the saved-for-backward bytes tracked; every
    rank's results."""
    import torch.distributed as dist

    from fidelity import run_config, tracked_step
    from megatron_hexi.training import Trainer, init_distributed

    config = run_config(iters + 1, "cpu")
    device = init_distributed(plan, config)
    trainer = Trainer(plan, config, device)
    metrics = [trainer.train_step(it) for it in range(iters)]
    last, activations = tracked_step(trainer, iters)
    metrics.append(last)
    out = {
        "rank": trainer.rank,
        "sequence_parallel": bool(trainer.transformer_config.sequence_parallel),
        "step_s": [m["step_time_s"] for m in metrics[:-1]],
        "loss": [m["lm_loss"] for m in metrics],
        "grad_norm": [m["grad_norm"] for m in metrics],
        "activations": activations,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, out)
    return everyone


def idle_check():
    """Before the run: the load average against the cores (fidelity.report_load, and its
    threshold, half the cores), printed with whether the machine counts as idle."""
    from fidelity import report_load

    cores = os.cpu_count() or 1
    report_load()
    load = os.getloadavg()[0]
    idle = load <= 0.5 * cores
    print(
        f"idle check: load average {load:.2f} on {cores} CPUs before the run: "
        f"{'idle' if idle else 'BUSY (other jobs are running; step times will be noisy)'}",
        flush=True,
    )
    return load


def _rel(a, b):
    return abs(a - b) / max(abs(b), 1e-30)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=600)
    a = ap.parse_args(argv)
    import yaml

    import sequence_parallel as this
    from fidelity import _cluster
    from harness import run_distributed
    from planner.models import load_model
    from planner.plan import build_plan
    from planner.simulator import simulate

    load_before = idle_check()
    runs = {(seq, v): [] for seq in a.seq for v in VARIANTS}
    plans = {}
    with tempfile.TemporaryDirectory(prefix="hexi-sequence-parallel-") as tmp:
        for seq in a.seq:
            path = Path(tmp) / f"model-{seq}.yaml"
            path.write_text(yaml.safe_dump({**MODEL, "seq_length": seq}))
            model = load_model(str(path))
            pipelines = [
                {
                    "micro_batch_size": 1,
                    "num_microbatches": 1,
                    "stages": [{"ranks": list(range(TP)), "layers": [0, MODEL["num_layers"]]}],
                }
            ]
            for name, on in VARIANTS.items():
                plans[seq, name] = build_plan(
                    _cluster(TP, None),
                    model,
                    1,
                    pipelines,
                    attention_backend="auto",
                    sequence_parallel=on,
                )
        for rnd in range(a.rounds):
            for key, plan in plans.items():
                per_rank = run_distributed(
                    this.train_rank,
                    TP,
                    plan,
                    a.warmup + a.steps,
                    timeout=a.timeout,
                    fresh=True,  # fresh interpreters: threads fixed before torch is imported
                    env={"OMP_NUM_THREADS": "1"},
                )[0]
                per_rank = sorted(per_rank, key=lambda r: r["rank"])
                flags = [r["sequence_parallel"] for r in per_rank]
                assert flags == [VARIANTS[key[1]]] * TP, (
                    f"seq {key[0]} sequence_parallel {key[1]}: the ranks ran with "
                    f"TransformerConfig.sequence_parallel {flags}"
                )
                runs[key].append(per_rank)
                steps = per_rank[0]["step_s"][a.warmup :]
                print(
                    f"round {rnd + 1} seq {key[0]} sequence parallel {key[1]:>3} (ranks ran "
                    f"sequence_parallel={flags}): steps (ms) "
                    f"{[round(s * 1e3, 1) for s in steps]}, activations (MB) "
                    f"{[round(r['activations'] / 1e6, 1) for r in per_rank]}, peak RSS (MB) "
                    f"{[round(r['peak_rss'] / 1e6) for r in per_rank]}, losses "
                    f"{[round(x, 6) for x in per_rank[0]['loss']]}",
                    flush=True,
                )
    load_after = os.getloadavg()[0]  # the run's own TP processes count in it
    print(f"load average {load_after:.2f} after the run (its own {TP} processes included)")

    # the same model and data: every launch's losses (and grad norms) against the first "off"
    worst_loss, worst_norm = {}, {}
    for seq in a.seq:
        ref = runs[seq, "off"][0][0]
        worst_loss[seq] = worst_norm[seq] = 0.0
        for name in VARIANTS:
            for launch in runs[seq, name]:
                for r in launch:
                    for x, y in zip(r["loss"], ref["loss"], strict=True):
                        worst_loss[seq] = max(worst_loss[seq], _rel(x, y))
                    for x, y in zip(r["grad_norm"], ref["grad_norm"], strict=True):
                        worst_norm[seq] = max(worst_norm[seq], _rel(x, y))

    print(
        f"\nmodel {MODEL['name']}: {MODEL['num_layers']} layers, hidden {MODEL['hidden_size']}, "
        f"{MODEL['num_attention_heads']} heads, FFN {MODEL['ffn_hidden_size']}, vocab "
        f"{MODEL['vocab_size']}; one stage of TP {TP}, 1 micro-batch of 1 sequence, fp32, "
        f"attention auto, dropout 0, gloo; {a.rounds} rounds of {a.steps} timed steps after "
        f"{a.warmup} warm-up; load {load_before:.1f} before, {load_after:.1f} after\n"
    )
    print(
        "| seq | sequence parallel | rank | activations MB (measured) | planner MB | error | "
        "peak RSS MB | fastest step ms | median step ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    acts, preds, rss, fastest, median = {}, {}, {}, {}, {}
    for (seq, name), launches in runs.items():
        steps = [s for launch in launches for s in launch[0]["step_s"][a.warmup :]]
        fastest[seq, name], median[seq, name] = min(steps), statistics.median(steps)
        terms = simulate(plans[seq, name]).memory_terms_gb
        for rank in range(TP):
            got = min(launch[rank]["activations"] for launch in launches)
            mem = min(launch[rank]["peak_rss"] for launch in launches)
            t = terms[rank]
            # the planner's bf16 activations in fp32 (x2), plus its fp32 logits term
            pred = (t["activations"] * 2 + t["logits"]) * 1e9
            acts[seq, name, rank], preds[seq, name, rank], rss[seq, name, rank] = got, pred, mem
            print(
                f"| {seq} | {name} | {rank} | {got / 1e6:.1f} | {pred / 1e6:.1f} | "
                f"{(pred - got) / got:+.0%} | {mem / 1e6:.0f} | {fastest[seq, name] * 1e3:.1f} | "
                f"{median[seq, name] * 1e3:.1f} |"
            )
    print()
    for seq in a.seq:
        for rank in range(TP):
            meas = acts[seq, "on", rank] / acts[seq, "off", rank]
            pred = preds[seq, "on", rank] / preds[seq, "off", rank]
            saved = acts[seq, "off", rank] - acts[seq, "on", rank]
            saved_pred = preds[seq, "off", rank] - preds[seq, "on", rank]
            print(
                f"seq {seq} rank {rank}: on / off activations {meas:.3f} (planner {pred:.3f}, "
                f"error {(pred - meas) / meas:+.1%}), peak RSS "
                f"{rss[seq, 'on', rank] / rss[seq, 'off', rank]:.3f}; bytes saved "
                f"{saved / 1e6:.2f} MB (planner {saved_pred / 1e6:.2f} MB, "
                f"{(saved_pred - saved) / saved:+.0%})"
            )
        print(
            f"seq {seq}: on / off fastest step {fastest[seq, 'on'] / fastest[seq, 'off']:.3f}, "
            f"median step {median[seq, 'on'] / median[seq, 'off']:.3f}"
        )
    print()
    ok = True
    for seq in a.seq:
        good = worst_loss[seq] <= LOSS_TOLERANCE
        ok &= good
        print(
            f"seq {seq}: losses on / off agree: max relative difference {worst_loss[seq]:.1e} "
            f"over {a.warmup + a.steps + 1} steps x {a.rounds} launches x {TP} ranks "
            f"({'OK' if good else 'MISMATCH'}, bound {LOSS_TOLERANCE:.0e}); grad norms "
            f"{worst_norm[seq]:.1e}"
        )
    print(
        f"sequence parallel ran on every rank of every 'on' launch and on none of the 'off' "
        f"launches ({a.rounds * len(a.seq)} launches each)"
    )
    print(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}]")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
