"""Devices: what the cost model knows of one GPU type, from the catalog or a measured profile.

Its own module so that the links (planner/topology.py) and both cost sources (planner/costmodel.py,
planner/measured_costs.py) share one Device without importing each other.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from planner.catalog import get_gpu
from planner.errors import SpecError
from planner.kernels import KernelDevice
from planner.profiles import ProfiledDevice, attach, read_profile

# Sustained fraction of catalog peak for the GEMM-dominated mix of a transformer layer (matmuls,
# attention, memory-bound norms and activations). Stated assumption: Megatron-LM reports 52-56 %
# model-FLOPs utilisation on A100 at scale with communication mostly hidden (Narayanan et al. 2021,
# 163 of 312 TFLOP/s; Korthikanti et al. 2022, Table 5), i.e. about 0.55 of peak for the compute
# itself. Catalog GPUs' layers and LM head are timed kernel by kernel instead (planner.kernels);
# this rate times the CPU row and weighs devices against each other in the search's heuristics.
# A measured device profile (`profile:` in the cluster file) replaces both.
SUSTAINED_FRACTION_OF_PEAK = 0.55

# Bytes of GPU memory traffic per parameter in one Adam step (memory-bound): read fp32 grad (4),
# read+write master (8), m (8), v (8), write the bf16 weight copy (2). Counted from the update.
ADAM_STEP_BYTES_PER_PARAM = 30


@dataclass(frozen=True)
class Device:
    """What the cost model needs of one GPU type: peak and sustained FLOP/s, memory, bandwidth."""

    name: str
    peak_flops: float
    flops: float  # sustained FLOP/s used for compute times
    memory_bytes: float
    mem_bw: float  # bytes/s
    source: str
    profile: ProfiledDevice | None = None  # a detailed (hexi-profile) profile, if any
    kernels: KernelDevice | None = None  # catalog GPUs: layers timed by planner.kernels


def device_for(gpu_name: str, profile: str | None = None, procs_per_node: int = 1) -> Device:
    """The Device of a catalog GPU, with a measured profile applied when the node group has one.

    Profile (JSON): {"device": "RTX-4090", "matmul_tflops": 96.0, "memory_gb": 23.6,
    "memory_bandwidth_gbs": 900, "source": "..."}: `matmul_tflops` is the measured sustained
    throughput of the layer's GEMM shapes and replaces peak x SUSTAINED_FRACTION_OF_PEAK; the other
    fields are optional overrides. A detailed profile (hexi-profile) is used as planner/profiles.py
    describes; `procs_per_node` sets its CPU contention.
    """
    gpu = get_gpu(gpu_name)
    if not profile:
        flat = f"catalog peak x {SUSTAINED_FRACTION_OF_PEAK}"
        kernels = None if gpu.name == "CPU" else KernelDevice(gpu.peak_flops, gpu.mem_bw_gbs * 1e9)
        return Device(
            gpu.name,
            gpu.peak_flops,
            gpu.peak_flops * SUSTAINED_FRACTION_OF_PEAK,
            gpu.memory_bytes,
            gpu.mem_bw_gbs * 1e9,
            flat if kernels is None else "catalog: kernel model (planner.kernels)",
            kernels=kernels,
        )
    data = read_profile(os.path.abspath(profile))
    if data.get("device", gpu.name) != gpu.name:
        raise SpecError(f"profile {profile}: is for {data['device']!r}, node holds {gpu.name}")
    achieved = float(data["matmul_tflops"]) * 1e12
    # a measured GEMM rate above the catalog peak means that peak is not this device's (the CPU
    # row is nominal): MFU is then taken against the measured rate, so it never exceeds 1
    return Device(
        gpu.name,
        max(gpu.peak_flops, achieved),
        achieved,
        float(data.get("memory_gb", gpu.memory_gb)) * 1e9,
        _optimizer_mem_bw(data, float(data.get("memory_bandwidth_gbs", gpu.mem_bw_gbs)) * 1e9),
        f"profile {profile}",
        attach(data, os.path.abspath(profile), procs_per_node),
    )


def _optimizer_mem_bw(data: Mapping[str, Any], default_bw: float) -> float:
    """The bandwidth that makes `optimizer_step_time` reproduce a profile's measured step time
    per parameter (ADAM_STEP_BYTES_PER_PARAM / s_per_param)."""
    per = (data.get("optimizer") or {}).get("s_per_param")
    return ADAM_STEP_BYTES_PER_PARAM / per if per else default_bw


def optimizer_step_time(params: float, mem_bw: float) -> float:
    """Adam step of `params` parameters: memory-bound, ADAM_STEP_BYTES_PER_PARAM bytes each."""
    return params * ADAM_STEP_BYTES_PER_PARAM / mem_bw
