"""Host time of this runtime's training step against plain megatron-core's: one rank, CPU.

    python tools/bench/host_overhead.py [--layers 16] [--hidden 64] [--seq 64]
        [--micro-batches 4] [--micro-batch-size 1] [--rounds 20] [--iters 4] [--warmup 3]
        [--profile N]

What is compared. One process builds both training loops of tools/bench/_overhead_workers.py
on the same one-rank plan (all layers on one stage): this runtime's Trainer, and megatron-core
alone as Megatron-LM trains (GPTModel with the same local layer spec and initial weights,
megatron's DistributedDataParallel, get_forward_backward_func, finalize_model_grads,
get_megatron_optimizer). Both read the same pre-materialised mock samples, fp32, dropout 0, so
they compute the same losses (printed). The layers are tiny (default hidden 64, 4 heads, seq 64,
vocabulary 256), so the kernels cost little and a step's time is mostly the host's: Python,
module dispatch and the framework's bookkeeping, which is what a GPU waits for when its kernels
are faster than the host issues them.

How. Compute threads are fixed (OMP_NUM_THREADS, default 1) before torch is imported. After an
idle check and --warmup untimed steps of each variant, each of --rounds rounds runs --iters
steps of each variant, alternating step by step (ours, plain, ours, plain; the next round starts
with plain), so machine-load drift hits both alike. A round's ratio is ours / plain of the
median process CPU time of its steps (the host's work; --clock wall uses wall time instead).
The result is the median of the round ratios, with their range; the last line is
`host overhead ratio: X.XXx`. Target: <= 1.02 (TARGET) at any depth and micro-batch count.

--profile N: afterwards, N more steps of each variant under cProfile; prints the functions whose
own CPU time per step differs most between the variants (where the runtime's excess goes).
"""

import os

# Compute threads, fixed before torch is imported (here and in everything imported below).
THREADS = int(os.environ.setdefault("OMP_NUM_THREADS", "1"))

import argparse  # noqa: E402
import gc  # noqa: E402
import shlex  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# The repository root first (tests/planner would shadow the planner package otherwise).
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent), str(ROOT / "tests")]

TARGET = 1.02  # median paired ours / plain host time


def model_dict(layers, hidden, seq):
    """The tiny model: head size 16, FFN 4 x hidden, vocabulary 256."""
    heads = max(hidden // 16, 1)
    return {
        "num_layers": layers,
        "hidden_size": hidden,
        "ffn_hidden_size": 4 * hidden,
        "num_attention_heads": heads,
        "num_query_groups": heads,
        "vocab_size": 256,
        "seq_length": seq,
        "name": "host-overhead",
    }


def build_plan(layers, hidden, seq, micro_batches, micro_batch_size):
    """A one-rank plan: one stage with every layer."""
    from planner.models import model_from_dict
    from planner.plan import build_plan as plan_from_pipelines
    from runtime.plans import cpu_cluster

    pipeline = {
        "micro_batch_size": micro_batch_size,
        "num_microbatches": micro_batches,
        "stages": [{"ranks": [0], "layers": [0, layers]}],
    }
    return plan_from_pipelines(
        cpu_cluster(1),
        model_from_dict(model_dict(layers, hidden, seq)),
        micro_batches * micro_batch_size,
        [pipeline],
    )


def build_loops(plan, iters):
    """{"ours": Loop, "plain": Loop} on `plan` in this process (a one-rank process group is
    made first)."""
    import _overhead_workers as workers
    from megatron_hexi.training import init_distributed

    init_distributed(plan, workers.run_config(iters))  # one process: an in-process store
    return workers.build_both(plan, plan, iters)


class Rounds:
    """Every timed step of both variants, by round."""

    def __init__(self):
        self.steps = {"ours": [], "plain": []}  # [[Step, ...] per round]

    def ratios(self, field):
        """Per round: ours / plain of the median `field` (cpu or total) of the round's steps."""
        return [
            statistics.median(getattr(s, field) for s in o)
            / statistics.median(getattr(s, field) for s in p)
            for o, p in zip(self.steps["ours"], self.steps["plain"])
        ]

    def median_ms(self, variant, field):
        return statistics.median(getattr(s, field) for r in self.steps[variant] for s in r) * 1e3


def profile(loops, steps, it, top=25):
    """Own CPU time per step of each function under cProfile, the variants' steps alternating;
    prints each variant's Python function calls per step (a count the machine's load does not
    change) and the functions whose time differs most (ours - plain)."""
    import cProfile
    import pstats

    profs = {v: cProfile.Profile(time.process_time) for v in ("ours", "plain")}
    for _ in range(steps):
        for v, prof in profs.items():
            prof.enable()
            loops[v].step(it[v])
            prof.disable()
            it[v] += 1
    own, calls = {}, {}
    for v, prof in profs.items():
        stats = pstats.Stats(prof).stats  # {(file, line, name): (cc, nc, tt, ct, callers)}
        own[v] = {k: (nc / steps, tt / steps) for k, (cc, nc, tt, ct, _) in stats.items()}
        calls[v] = sum(nc for nc, _ in own[v].values())
    rows = []
    for k in set(own["ours"]) | set(own["plain"]):
        o, p = own["ours"].get(k, (0, 0.0)), own["plain"].get(k, (0, 0.0))
        rows.append((o[1] - p[1], o, p, k))
    rows.sort(key=lambda r: -abs(r[0]))
    total = {v: sum(tt for _, tt in own[v].values()) * 1e3 for v in own}
    print(
        f"\nprofile ({steps} steps each, cProfile): Python calls per step ours {calls['ours']:.0f}"
        f", plain {calls['plain']:.0f}; own CPU time per step ours {total['ours']:.2f} ms, plain "
        f"{total['plain']:.2f} ms; largest differences:"
    )
    head = ("ours-plain ms", "ours ms", "calls", "plain ms", "calls")
    print("  {:>13} {:>8} {:>6} {:>8} {:>6}  function".format(*head))
    for d, o, p, (f, line, name) in rows[:top]:
        where = f"{Path(f).name}:{line}({name})" if line else name
        print(
            f"  {d * 1e3:13.3f} {o[1] * 1e3:8.3f} {o[0]:6.0f} {p[1] * 1e3:8.3f} {p[0]:6.0f}", where
        )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=64, help="hidden size (heads of 16)")
    p.add_argument("--seq", type=int, default=64, help="sequence length")
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--iters", type=int, default=4, help="steps of each variant per round")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps of each variant")
    p.add_argument("--clock", choices=["cpu", "wall"], default="cpu", help="what the ratio is of")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="profile N more steps")
    a = p.parse_args(argv)
    for name in ("layers", "hidden", "seq", "micro_batches", "micro_batch_size", "rounds", "iters"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if a.hidden % 16 or a.seq % 2:
        p.error("--hidden must be a multiple of 16 (heads of 16) and --seq even")
    if a.warmup < 0 or a.profile < 0:
        p.error("--warmup and --profile must not be negative")
    print("$ " + " ".join(shlex.quote(x) for x in [sys.executable, *sys.argv]), flush=True)
    from sequence_parallel import idle_check

    load0 = idle_check()
    iters = a.warmup + a.rounds * a.iters + a.profile
    plan = build_plan(a.layers, a.hidden, a.seq, a.micro_batches, a.micro_batch_size)
    m = plan.model
    import torch

    print(
        f"threads: {torch.get_num_threads()} (OMP_NUM_THREADS={THREADS}); model {m.num_layers}L "
        f"h{m.hidden_size} ffn{m.ffn_hidden_size} heads {m.num_attention_heads} vocab "
        f"{m.vocab_size} seq {m.seq_length}; {a.micro_batches} micro-batch(es) of "
        f"{a.micro_batch_size}; fp32, one rank; {a.warmup} warm-up + {a.rounds} rounds x "
        f"{a.iters} steps of each variant, alternating",
        flush=True,
    )
    start = time.monotonic()
    loops = build_loops(plan, iters)
    print(f"built both variants in {time.monotonic() - start:.1f} s", flush=True)
    it = {"ours": 0, "plain": 0}
    from _overhead_workers import alternate

    warm = alternate(loops, "ours", a.warmup, it)
    gc.collect()  # start the timed rounds from the same heap for both
    rounds = Rounds()
    field = "cpu" if a.clock == "cpu" else "total"
    for r in range(a.rounds):
        got = alternate(loops, "ours" if r % 2 == 0 else "plain", a.iters, it)
        for v in got:
            rounds.steps[v].append(got[v])
        ms = {
            (v, f): statistics.median(getattr(s, f) for s in got[v]) * 1e3
            for v in got
            for f in ("cpu", "total")
        }
        print(
            f"  round {r + 1:2d}: median ours {ms['ours', 'cpu']:7.2f} ms cpu "
            f"({ms['ours', 'total']:7.2f} wall), plain {ms['plain', 'cpu']:7.2f} ms cpu "
            f"({ms['plain', 'total']:7.2f} wall), ratio {rounds.ratios(field)[-1]:.3f}x "
            f"(load {os.getloadavg()[0]:.1f})",
            flush=True,
        )
    if a.profile:
        profile(loops, a.profile, it)
    losses = {
        v: [s.loss for s in warm[v]] + [s.loss for r in rounds.steps[v] for s in r] for v in it
    }
    diff = max(abs(x - y) / abs(y) for x, y in zip(losses["ours"], losses["plain"]))
    print(
        f"\nloss per step, same samples and initial weights: ours {losses['ours'][0]:.6f} -> "
        f"{losses['ours'][-1]:.6f}, plain {losses['plain'][0]:.6f} -> {losses['plain'][-1]:.6f}; "
        f"largest relative difference {diff:.1e}"
    )
    for v in ("ours", "plain"):
        print(
            f"{v:<5} median step {rounds.median_ms(v, 'total'):7.2f} ms wall, "
            f"{rounds.median_ms(v, 'cpu'):7.2f} ms CPU (fwd/bwd "
            f"{rounds.median_ms(v, 'fwd_bwd'):.2f} | finalize {rounds.median_ms(v, 'finalize'):.2f}"
            " ms)"
        )
    for name, f in (("CPU time", "cpu"), ("wall time", "total")):
        rs = rounds.ratios(f)
        print(
            f"paired ratio of {name} over {len(rs)} rounds: median {statistics.median(rs):.3f}x, "
            f"range {min(rs):.3f}x - {max(rs):.3f}x"
        )
    ratio = statistics.median(rounds.ratios(field))
    load1 = os.getloadavg()[0]
    print(
        f"target <= {TARGET}x ({a.clock} time): {'OK' if ratio <= TARGET else 'OVER'}; total "
        f"{time.monotonic() - start:.0f} s; load average {load0:.1f} -> {load1:.1f} on "
        f"{os.cpu_count()} CPUs"
    )
    print(f"host overhead ratio: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    from megatron_hexi.process_exit import exit_process

    exit_process(main())
