"""`hexi-profile`: measure this device's costs for a model and write a device profile JSON.

    hexi-profile --model tiny -o cpu.json [--device cpu|cuda] [--tp-widths 1 2 4]
        [--micro-batch-sizes 1 2 4] [--comm-procs 2] [--threads N] [--max-seconds 120]
        [--attention-backend auto]   # the attention training will run (the plan's)

Reference the file from the cluster spec: `nodes: [{name: .., gpu: CPU, profile: cpu.json}]`.
Progress goes to stderr; the run stops measuring new points when --max-seconds is near (what
was measured is written, with `complete: false`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, NoReturn, TextIO

from megatron_hexi.profile import FORMAT
from planner.attention import CLI_DEFAULT_BACKEND
from planner.cli_args import add_attention_backend_flag, with_examples

if TYPE_CHECKING:
    import torch

    from megatron_hexi.profile.records import (
        CommRecord,
        ContentionProbe,
        ContentionRecord,
        EndRecord,
        LayerRecord,
        Profile,
    )
    from planner.models import ModelSpec

# The share of --max-seconds kept for what runs after the grid (optimizer, bursts, the comm
# job's measuring): a grid point after the first, or a burst between rounds, starts only while
# this much of the budget is left.
GRID_RESERVE = 0.45


class Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total: int, budget: float, stream: TextIO = sys.stderr) -> None:
        self.total, self.done, self.budget, self.stream = total, 0, budget, stream
        self.start = time.monotonic()
        self.tty = stream.isatty()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.budget - self.elapsed()

    def step(self, what: str) -> None:
        self.done += 1
        width = 24
        fill = int(width * self.done / max(self.total, 1))
        line = (
            f"hexi-profile [{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} "
            f"{self.elapsed():5.1f}s/{self.budget:g}s {what}"
        )
        self.stream.write(("\r" + line.ljust(100)) if self.tty else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _init_single_rank(device: torch.device) -> bool:
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    return True


def profile(
    model: ModelSpec,
    device_type: str = "cpu",
    tp_widths: Iterable[int] = (1, 2),
    micro_batch_sizes: Iterable[int] = (1, 2, 4),
    comm_procs: int = 0,
    threads: int | None = None,
    max_seconds: float = 120.0,
    device_name: str | None = None,
    reps: int | None = None,
    runtime: bool = True,
    progress_stream: TextIO = sys.stderr,
    rounds: int = 3,
    attention_backend: str = CLI_DEFAULT_BACKEND,
) -> Profile:
    """Measure and return the profile dict (see megatron_hexi.profile). `attention_backend`:
    the one every measured stage runs (the runtime's --attention-backend), recorded."""
    import torch

    from megatron_hexi.model import seed_rng
    from megatron_hexi.profile import comm, measure, runtime_overhead
    from planner.catalog import match_device_name

    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    if threads is None:
        threads = int(os.environ.get("OMP_NUM_THREADS", "1")) if device.type == "cpu" else 1
    torch.set_num_threads(threads)
    if device.type == "cpu":
        from megatron_hexi.patches import apply_cpu_patches

        apply_cpu_patches()
        dtype = torch.float32
        name = device_name or "CPU"
    else:
        torch.cuda.set_device(device)
        dtype = torch.bfloat16
        gpu = match_device_name(torch.cuda.get_device_name(device))
        name = device_name or (gpu.name if gpu else torch.cuda.get_device_name(device))
    started = _init_single_rank(device)
    seed_rng(1234, 0)
    widths = measure.sizes_for(model, tp_widths)
    mbss = sorted(set(micro_batch_sizes))
    # budget shares: compute grid (layers and ends) 55 %, optimizer + runtime 10 %, comm 20 %+
    n_units = (
        len(widths) * len(mbss) * rounds
        + 3
        + (2 if comm_procs > 1 else 0)
        + (rounds + 1 if runtime else 0)
    )
    bar = Progress(n_units, max_seconds, progress_stream)
    out: Profile = {
        "format": FORMAT,
        "device": name,
        "dtype": str(dtype).replace("torch.", ""),
        "attention_backend": attention_backend,
        "threads": threads,
        "cpu_cores": os.cpu_count(),
        "host": platform.node(),
        "torch": torch.__version__,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "model": {k: v for k, v in model.__dict__.items()},
        "layer": [],
        "embedding": [],
        "head": [],
    }
    job = None
    if comm_procs > 1:
        # started first, so that its processes sleep through the grid (comm.py says why)
        job = comm.CommJob(
            comm_procs,
            threads,
            device.type,
            reps or 5,
            wait_s=max_seconds + 300,
            layer_job=comm.LayerJob(
                model,
                mbss,
                reps or 5,
                out["dtype"],
                widths[0] if device.type == "cpu" else 0,
                attention_backend,
            ),
        )
        ready = job.wait_ready(max(60.0, max_seconds))
        bar.step(
            f"comm job of {comm_procs} started"
            + (f"; data-parallel step {ready['step_s'] * 1e3:.1f} ms" if ready["step_s"] else "")
        )
    measure.warm_up(
        model, device, dtype, min(3.0, 0.03 * max_seconds), attention_backend=attention_backend
    )
    out["matmul_tflops"] = measure.matmul_tflops(
        model, max(mbss), device, dtype, seconds=min(0.5, max_seconds * 0.02)
    )
    bar.step(f"matmul {out['matmul_tflops'] * 1e3:.1f} GFLOP/s")
    # One-rank Trainer steps (the runtime's overheads, runtime_overhead.py) in bursts spread over
    # the profile: before the grid, after each grid round but the last, after the optimizer; each
    # next to a data-parallel burst of the comm job (its first one ran as it started).
    bursts: list[dict[int, float]] = []
    params: int | None = None

    def burst(when: str, data_parallel: bool = True) -> None:
        nonlocal params
        dp = job.burst() if job is not None and data_parallel else None
        pts, params = runtime_overhead.step_points(model, device, reps or 4, attention_backend)
        bursts.append(pts)
        bar.step(
            f"one-rank Trainer steps {when}: "
            + ", ".join(f"{k} micro-batch(es) {t * 1e3:.1f} ms" for k, t in sorted(pts.items()))
            + (f"; data-parallel {dp * 1e3:.1f} ms" if dp else "")
        )

    if runtime:
        burst("before the grid", data_parallel=False)
    # The grid is measured in rounds, each visiting every point, so that a slow spell of the
    # machine hits one round of a point rather than all of its runs (measure.py: statistic).
    points = [(t, b) for t in widths for b in mbss]
    got: dict[tuple[int, int], list[tuple[LayerRecord, dict[str, EndRecord]]]] = {}
    for rnd in range(rounds):
        for t, b in points:
            if bar.left() < max_seconds * GRID_RESERVE and got:
                break
            e = measure.layer_entry(
                model, t, b, device, dtype, reps or 4, attention_backend=attention_backend
            )
            ends = measure.end_entries(
                model, t, b, device, dtype, reps or 4, attention_backend=attention_backend
            )
            got.setdefault((t, b), []).append((e, ends))
            bar.step(
                f"round {rnd + 1} layer tp{t} mbs{b}: fwd {e['fwd_s'] * 1e3:.2f} ms bwd "
                f"{e['bwd_s'] * 1e3:.2f} ms"
            )
        if runtime and rnd < rounds - 1 and bar.left() > max_seconds * GRID_RESERVE:
            burst(f"after round {rnd + 1}")
    complete = len(got) == len(points)
    median = statistics.median
    for runs in got.values():
        out["layer"].append(measure.combine_layers([e for e, _ in runs], min))
        out["embedding"].append(measure.combine_ends([x["embedding"] for _, x in runs], median))
        out["head"].append(measure.combine_ends([x["head"] for _, x in runs], median))
    opt = measure.optimizer_entry(model, device, dtype, reps or 5)
    out["optimizer"] = opt
    bar.step(f"optimizer {opt['s_per_param'] * 1e9:.2f} ns/param + {opt['fixed_s'] * 1e3:.2f} ms")
    # at least two bursts however little time is left: the fastest of one could be a slow spell
    if runtime and (bar.left() > 0.2 * max_seconds or len(bursts) < 2):
        burst("after the optimizer")
    one_rank = {k: min(b[k] for b in bursts) for k in bursts[0]} if bursts else None
    if started:
        import torch.distributed as dist

        dist.destroy_process_group()
    if job is not None:
        c = job.finish(max(bar.left(), 5.0) * 0.8)
        ref = next(
            (e for e in out["layer"] if e["mbs"] == max(mbss) and e["tp"] == widths[0]), None
        )
        cont = contention(c.pop("contention"), ref, one_rank, c) if "contention" in c else None
        if cont is not None:
            out["contention"] = cont
            train = cont.get("training")
            # contention() says why this bounds the point; it sets it only from a one-rank step
            # of the same micro-batches, so one_rank exists
            if train is not None and "one_rank_step_s" in train:
                assert one_rank is not None
                one_rank[train["microbatches"]] = train["one_rank_step_s"]
        if "tp_layer" in c:
            out["tp_layer"] = c.pop("tp_layer")
        out["comm"] = c
        fit = c["fit"]["allreduce"]
        bar.step(
            f"comm {comm_procs} procs: all-reduce {fit['bandwidth_gbs']:.2f} GB/s, "
            f"{fit['latency_us']:.0f} us"
            if fit
            else "comm: too few points"
        )
    if one_rank:
        assert params is not None  # burst() sets it with every one-rank burst
        predicted = runtime_overhead.predicted_steps(out, model, device.type, list(one_rank))
        rt = out["runtime"] = runtime_overhead.overheads(one_rank, predicted, params)
        rt["bursts"] = [{str(k): t for k, t in sorted(b.items())} for b in bursts]
        bar.step(
            f"runtime {rt['per_microbatch_s'] * 1e3:.2f} ms/micro-batch + "
            f"{rt['per_step_s'] * 1e3:.2f} ms/step"
        )
    else:
        bar.step("runtime overheads skipped")
    bar.close()
    out["complete"] = complete
    out["seconds"] = round(bar.elapsed(), 2)
    out["source"] = (
        f"hexi-profile on {out['host']} ({name}, {threads} thread(s), "
        f"{out['dtype']}), {out['date']}"
    )
    return out


def contention(
    cont: ContentionProbe,
    ref: LayerRecord | None,
    one_rank: Mapping[int, float] | None,
    comm_result: CommRecord,
) -> ContentionRecord | None:
    """The profile's `contention` entry. Preferred: the runtime's own data-parallel step on
    `procs` processes, less its gradient all-reduce (the measured curve, fp32 gradients), over the
    one-rank step with the same micro-batches (`one_rank`: {micro-batches: fastest step}); else
    the layer probe (all at once vs alone). Processes that share a node never run faster than
    one alone, so a data-parallel step (less its all-reduce) below the one-rank step shows that
    every one-rank burst met a slow spell: it then stands for the one-rank step as well
    (`training.one_rank_step_s`, and hexi-profile's runtime overheads)."""
    from planner.profiles import _loglog

    probe = None
    if ref is not None:  # the grid point the probe compares with was measured
        cont["alone_s"] = ref["fwd_s"] + ref["bwd_s"]
        probe = cont["together_s"] / cont["alone_s"]
    train = cont.pop("training", None)
    one = (one_rank or {}).get(train["microbatches"]) if train else None
    curve = [(p["bytes"], p["s"]) for p in comm_result.get("allreduce", [])]
    if train and one and len(curve) >= 2:
        sync = _loglog(curve, 4 * train["params"])
        alone = min(one, train["step_s"] - sync)
        train.update(
            {"one_rank_step_s": alone, "one_rank_measured_s": one, "grad_allreduce_s": sync}
        )
        return {
            "slowdown": (train["step_s"] - sync) / alone,
            "probe_slowdown": probe,
            "training": train,
            **cont,
        }
    if probe is None:
        return None  # nothing to compare with: the profile has no contention entry
    return {"slowdown": probe, **cont}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hexi-profile",
        description=__doc__.splitlines()[0],
        **with_examples(
            "hexi-profile --model tiny --device cpu --max-seconds 30 -o cpu-profile.json",
            "hexi-profile --model llama2-7b --device cuda --tp-widths 1 2 --comm-procs 2 "
            "-o rtx4090.json",
            note="Reference the file from the cluster spec: `profile: cpu-profile.json` in a "
            "node group.",
        ),
    )
    p.add_argument("--model", required=True, help="catalog model name or model YAML")
    p.add_argument("--seq-length", type=int, default=None)
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default=None,
        help="default: cuda when available, else cpu",
    )
    p.add_argument(
        "--device-name",
        default=None,
        help="catalog GPU name to record (default: CPU, or the CUDA device's catalog match)",
    )
    add_attention_backend_flag(p)
    p.add_argument("--tp-widths", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--micro-batch-sizes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument(
        "--comm-procs",
        type=int,
        default=0,
        help="also time collectives on this many local processes (>= 2)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per process (default: OMP_NUM_THREADS, else 1, as "
        "torchrun runs each rank)",
    )
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (default: by budget)")
    p.add_argument("--no-runtime", action="store_true", help="skip the runtime-overhead runs")
    p.add_argument("--max-seconds", type=float, default=120.0)
    p.add_argument("-o", "--output", required=True)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from planner.errors import SpecError
    from planner.models import load_model

    try:
        model = load_model(args.model)
        if args.seq_length:
            import dataclasses

            model = dataclasses.replace(model, seq_length=args.seq_length)
    except SpecError as e:
        for line in e.problems:
            print(f"hexi-profile: error: {line}", file=sys.stderr)
        return 2
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("hexi-profile: error: --device cuda, but torch sees no CUDA device", file=sys.stderr)
        return 2
    if args.comm_procs == 1 or args.comm_procs < 0:
        print("hexi-profile: error: --comm-procs needs at least 2 processes", file=sys.stderr)
        return 2
    out = profile(
        model,
        device,
        args.tp_widths,
        args.micro_batch_sizes,
        args.comm_procs,
        args.threads,
        args.max_seconds,
        args.device_name,
        args.reps,
        runtime=not args.no_runtime,
        attention_backend=args.attention_backend,
    )
    with open(args.output, "w") as f:
        json.dump(out, f, indent=1)
    print(
        f"wrote {args.output}: {out['device']}, {len(out['layer'])} layer points, matmul "
        f"{out['matmul_tflops'] * 1e3:.1f} GFLOP/s, {out['seconds']:.1f} s"
        f"{'' if out['complete'] else ' (incomplete: --max-seconds reached)'}"
    )
    return 0


def cli() -> NoReturn:
    """The hexi-profile command: main, then a deliberate exit (it may have used torch.distributed;
    megatron_hexi.process_exit says why)."""
    from megatron_hexi.process_exit import exit_process

    exit_process(main())


if __name__ == "__main__":
    cli()
