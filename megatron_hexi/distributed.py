"""Start-up and failure of a training process: the device and the process group
(`init_distributed`), the start-up lines with their times (read from /proc), the CPU thread
warning, and the one clear error a rank prints when it fails after start-up.

Order of start-up matters: flags and plan are checked before the process group exists, the world
size before any collective, and the process mapping (one all-gather) before any group is built,
so every mismatch is one clear error on every rank instead of a hang.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from typing import TYPE_CHECKING, NoReturn

import torch
import torch.distributed as dist

from megatron_hexi.rank_mapping import check_world_size
from megatron_hexi.report import shown
from planner.errors import SpecError

if TYPE_CHECKING:
    from megatron_hexi.config import RunConfig, RuntimeConfig
    from planner.plan import Plan


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that a clock read after it measures that work
    (CUDA runs asynchronously; on CPU there is nothing to wait for)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def seconds_since_process_start() -> float:
    """Wall time since this process started (Linux: /proc), else since this module's import."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED


_IMPORTED = time.monotonic()


def startup_line(what: str) -> None:
    """A start-up phase on launch rank 0, with the seconds since the process started (imports
    and process-group set-up take most of a CPU launch's first seconds)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"> {what} [{seconds_since_process_start():.1f} s]", flush=True)


def fail(exc: Exception, config: RunConfig) -> NoReturn:
    """A rank's failure after the process group exists: one clear message, then exit at once
    (tearing down a group whose peer died can hang)."""
    import traceback

    lines, collective = failure_lines(exc, config)
    if not collective:
        traceback.print_exc()
    for line in lines:
        print(line, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)


def failure_lines(exc: Exception, config: RunConfig) -> tuple[list[str], bool]:
    """The error lines for a failure after start-up, and whether a collective failed."""
    rank = dist.get_rank() if dist.is_initialized() else "?"
    collective = isinstance(exc, getattr(dist, "DistError", ())) or any(
        word in str(exc)
        for word in (
            "gloo",
            "Gloo",
            "NCCL",
            "Connection",
            "connection",
            "Timed out",
            "timed out",
            "timeout",
        )
    )
    # gloo words one cause two ways: a wait's timeout ("Timed out waiting ...") or, when the
    # rank was blocked reading from the peer, the pair's ("Application timeout caused pair
    # closure"); NCCL's watchdog says "timed out"
    timed_out = any(w in str(exc) for w in ("Timed out", "timed out", "Application timeout"))
    first_line = (str(exc).strip().splitlines() or [""])[0][:300]
    lines = [f"pretrain_gpt.py: error: launch rank {rank}: {type(exc).__name__}: {first_line}"]
    if collective:
        cause = (
            "it timed out: another rank hung or stopped answering"
            if timed_out
            else "another rank died, hung or lost its connection"
        )
        lines.append(
            f"pretrain_gpt.py: error: launch rank {rank}: a collective failed: {cause} "
            f"(collective timeout --distributed-timeout-minutes "
            f"{config.runtime.distributed_timeout_minutes:g})"
        )
        save = config.checkpoint.save
        if save:
            lines.append(f"pretrain_gpt.py: error: {resume_advice(save)}")
    return lines, collective


def resume_advice(save: str) -> str:
    """What to rerun after a failure: --load only where a checkpoint that loads exists."""
    from megatron_hexi.checkpoint import last_loadable

    found, where = last_loadable(save), shown(save, 200)
    if found is None:
        return f"last complete checkpoint: none in {where}; rerun the same command to start over"
    return (
        f"last complete checkpoint: {found} in {where}; rerun the same command with --load "
        f"{where} to resume"
    )


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity, which a container or Slurm narrows)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def report_cpu_threads() -> None:
    """On CPU, say on each node's first process how many compute threads the node's processes
    run, and warn when they exceed its cores: oversubscribed ranks wait for a core inside every
    collective, and steps slow down several times (set OMP_NUM_THREADS before the launch)."""
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return
    procs = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    threads, cores = torch.get_num_threads(), available_cores()
    print(
        f"CPU: {procs} process(es) on this node x {threads} compute thread(s) each, "
        f"{cores} core(s)",
        flush=True,
    )
    if procs * threads > cores:
        print(
            f"WARNING: {procs} x {threads} compute threads on {cores} cores oversubscribe this "
            f"node; set OMP_NUM_THREADS={max(cores // procs, 1)} before the launch",
            file=sys.stderr,
            flush=True,
        )


def wants_cuda(runtime: RuntimeConfig) -> bool:
    """Whether this run is on CUDA: --hetero-device cuda, or no --hetero-device and a CUDA
    device torch sees."""
    return runtime.device == "cuda" or (runtime.device is None and torch.cuda.is_available())


def init_distributed(plan: Plan | None, config: RunConfig) -> torch.device:
    """Device choice, world-size check (against a plan file's; a plan made at start-up fits the
    world by construction), then the process group (with the timeout); returns the device.
    A process group that exists already (a test harness) is kept."""
    rt = config.runtime
    want_cuda = wants_cuda(rt)
    if want_cuda and not torch.cuda.is_available():
        raise SpecError("--hetero-device cuda, but torch sees no CUDA device")
    if plan is not None:
        check_world_size(plan, int(os.environ.get("WORLD_SIZE", "1")))
    if want_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        from megatron_hexi.patches import apply_cpu_patches

        apply_cpu_patches()
        report_cpu_threads()
    if os.environ.get("HEXI_STRICT_COLLECTIVES") == "1":
        from megatron_hexi.strict_collectives import install

        install(device)
    backend = rt.distributed_backend or ("nccl" if want_cuda else "gloo")
    timeout = datetime.timedelta(minutes=rt.distributed_timeout_minutes)
    if dist.is_initialized():
        pass
    elif "MASTER_ADDR" not in os.environ and os.environ.get("WORLD_SIZE", "1") == "1":
        # one process started without a launcher: an in-process store, no TCP port (a fixed
        # default port fails whenever something else on the machine holds it)
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
    else:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        dist.init_process_group(backend, timeout=timeout)
    return device
