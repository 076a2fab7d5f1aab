"""Run every benchmark with one command and print the ratios measured in this run.

    python tools/bench/run_all.py [--quick] [--skip NAME ...] [--log-dir DIR]

Benchmarks (each its own process, output streamed and kept under --log-dir):
  sync_volume       gradient-sync bytes vs lower bound (examples/plans/hetero-4rank.json)
  runtime_overhead  step time of this runtime / plain megatron-core (TP2, PP2, DP2; 2 CPU processes)
  host_overhead     host time of this runtime's step / plain megatron-core's (one rank, tiny layers)
  fidelity          cost model vs runtime step times and memory (profile + 9 plans)
  search_quality    hexi / exhaustive and hexi / uniform throughput
  planner_scaling   search seconds vs GPUs
  checkpoint_verify --load time with / without checksum and NaN checks (1 and 2 CPU processes)
  init_startup      one rank's weight initialisation: per-block seeds against full tensors
  sequence_parallel TP-2 stage, sequence parallelism off / on: activations, RSS, step (2 CPU procs)
--quick shrinks the slow ones (fewer steps, clusters and sizes); the page docs/benchmarks.md
says which settings produced its figures.
"""

import argparse
import datetime
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = Path(__file__).resolve().parent


def commands(quick):
    py = sys.executable
    return {
        "sync_volume": [py, str(BENCH / "sync_volume.py")],
        "runtime_overhead": [py, str(BENCH / "runtime_overhead.py")]
        + (["--iters", "3", "--warmup", "2", "--rounds", "3"] if quick else []),
        "host_overhead": [py, str(BENCH / "host_overhead.py")]
        + (["--layers", "4", "--rounds", "5"] if quick else []),
        "fidelity": [py, "-W", "ignore", str(BENCH / "fidelity.py")]
        + (
            ["--steps", "4", "--warmup", "2", "--rounds", "1", "--max-profile-seconds", "60"]
            if quick
            else []
        ),
        "search_quality": [py, str(BENCH / "search_quality.py")]
        + (["--clusters", "5", "--max-gpus", "8", "--uniform-extra", "3"] if quick else []),
        "planner_scaling": [py, str(BENCH / "planner_scaling.py")]
        + (["--sizes", "64", "256", "1024"] if quick else []),
        "checkpoint_verify": [py, str(BENCH / "checkpoint_verify.py")]
        + (["--hidden", "256", "--vocab", "4096", "--rounds", "3"] if quick else []),
        "init_startup": [py, str(BENCH / "init_startup.py")]
        + (["--rounds", "1"] if quick else ["--rounds", "3"]),
        "sequence_parallel": [py, "-W", "ignore", str(BENCH / "sequence_parallel.py")]
        + (["--seq", "1024", "--rounds", "1", "--steps", "2"] if quick else []),
    }


# (benchmark, regex on its output, label): the ratios the summary prints
RATIOS = [
    ("sync_volume", r"ratio (\d+\.\d+)\s*$", "sync bytes / lower bound"),
    (
        "runtime_overhead",
        r"worst paired ratio of the uniform cases (\d+\.\d+)x",
        "runtime / megatron-core step (worst, paired)",
    ),
    ("host_overhead", r"^host overhead ratio: (\d+\.\d+)x", "runtime / megatron-core host time"),
    (
        "fidelity",
        r"mean \|error\| (\d+\.\d+)%.*max \|error\| (\d+\.\d+)%",
        "cost model step-time |error| mean, max (%)",
    ),
    (
        "fidelity",
        r"activations mean \|error\| (\d+\.\d+)%, max (\d+\.\d+)%",
        "activation memory |error| mean, max (%)",
    ),
    (
        "search_quality",
        r"hexi / exhaustive: n=(\d+) min=(\S+) median=(\S+)",
        "hexi / exhaustive (n, min, median)",
    ),
    (
        "search_quality",
        r"hexi / uniform: n=(\d+) min=(\S+) median=(\S+)",
        "hexi / uniform (n, min, median)",
    ),
    ("planner_scaling", r"^\s*(\d+)\s+(\d+\.\d+)\s", "search seconds at GPUs"),
    (
        "checkpoint_verify",
        r"same plan ratio (\d+\.\d+)x, resharded ratio (\d+\.\d+)x",
        "verified / plain --load time (same plan, resharded)",
    ),
    (
        "init_startup",
        r"blocks against full tensors: (\d+\.\d+)x faster, peak RSS (\d+\.\d+)x lower",
        "weight init: full tensors / blocks (time, peak RSS)",
    ),
    (
        "sequence_parallel",
        r"^seq (\d+) rank 0: on / off activations (\d+\.\d+) \(planner (\d+\.\d+)",
        "sequence parallel on / off activations (seq, measured, planner)",
    ),
    (
        "sequence_parallel",
        r"^seq (\d+): on / off fastest step (\d+\.\d+)",
        "sequence parallel on / off fastest step (seq, ratio)",
    ),
]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip", nargs="*", default=[])
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--log-dir", default=str(ROOT / "runs/bench"))
    a = ap.parse_args(argv)
    logs = Path(a.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    print(
        f"# run_all {datetime.datetime.now():%Y-%m-%d %H:%M}, commit {commit} (+ working "
        f"tree), load {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs",
        flush=True,
    )
    outputs, status = {}, {}
    for name, cmd in commands(a.quick).items():
        if name in a.skip or (a.only is not None and name not in a.only):
            continue
        print(
            f"\n## {name}\n$ {' '.join(Path(c).name if c == sys.executable else c for c in cmd)}",
            flush=True,
        )
        t = time.monotonic()
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
        lines = []
        for line in proc.stdout:
            if "Warning" in line or "warnings.warn" in line:
                continue
            lines.append(line)
            print(line, end="", flush=True)
        status[name] = proc.wait()
        outputs[name] = "".join(lines)
        (logs / f"{name}.log").write_text(outputs[name])
        print(
            f"[{name}: exit {status[name]}, {time.monotonic() - t:.0f} s, load "
            f"{os.getloadavg()[0]:.1f}]",
            flush=True,
        )
    print("\n# ratios measured in this run")
    for name, pattern, label in RATIOS:
        if name not in outputs:
            continue
        found = re.findall(pattern, outputs[name], re.M)
        if not found:
            print(f"  {label}: not found (exit {status[name]})")
        elif name == "planner_scaling":
            print(f"  {label}: " + ", ".join(f"{g} GPUs {s} s" for g, s in found))
        else:
            last = found[-1]
            print(f"  {label}: {', '.join(last) if isinstance(last, tuple) else last}")
    return 0 if all(v == 0 for v in status.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
