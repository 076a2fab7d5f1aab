"""Refuse, before anything is allocated, a plan whose ranks cannot fit the memory they have.

The estimate is the planner's own (planner.memory_fit: the simulator's per-rank peak, the number
`hexi-plan simulate` prints), compared with what each device has:
* CUDA: the device's total memory, summed estimate of the ranks that share the device;
* CPU: the memory the host can still give, /proc/meminfo's MemAvailable or the cgroup's limit
  minus its usage, whichever is smaller, against the summed estimate of every rank on the host
  (CPU processes share its memory). The estimate's framework reserve (a CUDA context and the
  caching allocator's slack) is left out there: a CPU process holds its libraries already, and
  the available memory is measured after they were loaded.
One all-gather shares every rank's device and capacity; every rank computes the same verdict and
stops with the same AgreedError, which names the ranks and the numbers.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist

from megatron_hexi.report import AgreedError, shown
from planner.errors import SpecError
from planner.memory_fit import estimate_of
from planner.plan import Plan

if TYPE_CHECKING:
    from planner.simulator import Estimate

GB = 1e9


class DeviceMemory(NamedTuple):
    """What one process can use: its host, its device ('cpu' or 'cuda:N') and the bytes."""

    launch_rank: int
    plan_rank: int
    host: str
    device: str
    capacity: int
    source: str


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().split()[0]
    except (OSError, IndexError):
        return None
    return int(text) if text.isdigit() else None


def cgroup_headroom() -> int | None:
    """Bytes the process's cgroup may still take (v2 memory.max - memory.current, or v1
    limit - usage); None without a limit."""
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        ),
    ):
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        if limit is not None and usage is not None and limit < 1 << 60:
            return max(limit - usage, 0)
    return None


def host_available() -> tuple[int, str]:
    """(bytes the host can still give this process's group, where the number comes from)."""
    available, source = None, ""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available, source = int(line.split()[1]) * 1024, "MemAvailable"
    except (OSError, ValueError, IndexError):
        pass
    headroom = cgroup_headroom()
    if headroom is not None and (available is None or headroom < available):
        available, source = headroom, "cgroup limit minus usage"
    if available is None:  # not Linux: the physical memory
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        source = "physical memory"
    return available, source


def local_memory(device: torch.device, plan_rank: int) -> DeviceMemory:
    """This process's DeviceMemory."""
    host = socket.gethostname()
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        total = torch.cuda.get_device_properties(index).total_memory
        return DeviceMemory(
            dist.get_rank(), plan_rank, host, f"cuda:{index}", total, "total memory"
        )
    available, source = host_available()
    return DeviceMemory(dist.get_rank(), plan_rank, host, "cpu", available, source)


def _estimate(plan: Plan) -> Estimate:
    """The planner's estimate; a measured profile the plan's cluster names but this machine
    cannot read changes only speed and capacity, not the memory a rank needs, so the estimate is
    then made without it."""
    try:
        return estimate_of(plan)
    except SpecError:
        if not any(g.profile for g in plan.cluster.groups):
            raise
    groups = [dataclasses.replace(g, profile=None) for g in plan.cluster.groups]
    cluster = dataclasses.replace(plan.cluster, groups=groups)
    return estimate_of(dataclasses.replace(plan, cluster=cluster))


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def fit_problems(plan: Plan, everyone: Sequence[DeviceMemory]) -> list[str]:
    """One line per device (or CPU host) whose ranks' estimated peak exceeds its capacity."""
    est = _estimate(plan)
    groups: dict[tuple[str, str], list[DeviceMemory]] = {}
    for m in everyone:
        groups.setdefault((m.host, m.device), []).append(m)
    problems = []
    for (host, device), members in groups.items():
        cpu = device == "cpu"
        need = sum(
            (
                est.peak_memory_gb[m.plan_rank]
                - (est.memory_terms_gb[m.plan_rank].get("reserve", 0.0) if cpu else 0.0)
            )
            * GB
            for m in members
        )
        capacity = max(m.capacity for m in members)
        if need <= capacity:
            continue
        ranks = sorted(m.plan_rank for m in members)
        launch = sorted(m.launch_rank for m in members)
        where = (
            f"host {shown(host)} (CPU processes, launch {_ranks(launch)})"
            if cpu
            else f"host {shown(host)} {device} (launch {_ranks(launch)})"
        )
        problems.append(
            f"memory: plan {_ranks(ranks)} on {where} need {need / GB:.2f} GB by the plan's "
            f"estimate (hexi-plan simulate), the {'host' if cpu else 'device'} has "
            f"{capacity / GB:.2f} GB ({members[0].source}): the plan cannot fit; re-plan for "
            f"these devices (hexi-plan plan), or lower the micro-batch size or sequence length"
        )
    return problems


def check_memory_fit(plan: Plan, device: torch.device, device_name: str) -> None:
    """Refuse the plan on every rank if some device cannot hold its ranks (collective)."""
    from megatron_hexi.rank_mapping import map_processes

    mapping = map_processes(plan, device_name, check_devices=device.type == "cuda")
    mine = local_memory(device, mapping[dist.get_rank()])
    everyone: list[DeviceMemory | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    problems = fit_problems(plan, [m for m in everyone if m is not None])
    if problems:
        raise AgreedError(problems)


__all__ = ["DeviceMemory", "check_memory_fit", "fit_problems", "host_available"]
