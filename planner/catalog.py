"""The GPU catalog: peak dense throughput, memory and memory bandwidth per GPU type.

The numbers live in data/gpus.yaml, one row per GPU with its source, so that they can be checked
and extended without touching code.
"""

from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

import yaml

from planner.errors import SpecError


@dataclass(frozen=True)
class GpuType:
    name: str
    tflops: float  # dense BF16/FP16 tensor TFLOPS, FP32 accumulate
    memory_gb: float  # usable memory, 1e9 bytes
    mem_bw_gbs: float  # memory bandwidth, GB/s
    aliases: tuple[str, ...]
    source: str
    bf16: bool = True  # has bf16 tensor cores (V100 and T4 do not: they train in fp16)

    @property
    def peak_flops(self) -> float:
        return self.tflops * 1e12

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * 1e9


@lru_cache(maxsize=1)
def gpu_catalog() -> dict[str, GpuType]:
    """{name: GpuType} read from the packaged data file."""
    rows = yaml.safe_load(resources.files("planner").joinpath("data/gpus.yaml").read_text())
    return {
        r["name"]: GpuType(
            r["name"],
            float(r["tflops"]),
            float(r["memory_gb"]),
            float(r["mem_bw_gbs"]),
            tuple(r.get("aliases", ())),
            r["source"],
            bool(r.get("bf16", True)),
        )
        for r in rows
    }


def get_gpu(name: object, where: str = "gpu") -> GpuType:
    """Look a GPU up by catalog name (case-insensitive); a one-line error lists the choices."""
    catalog = gpu_catalog()
    if isinstance(name, str) and name in catalog:
        return catalog[name]
    for key, gpu in catalog.items():
        if str(name).lower() == key.lower():
            return gpu
    raise SpecError(f"{where}: unknown GPU type {name!r}; known: {', '.join(catalog)}")


def match_device_name(device_name: str) -> GpuType | None:
    """Catalog entry for a name that torch / nvidia-smi reports, or None."""
    for gpu in gpu_catalog().values():
        if device_name == gpu.name or device_name in gpu.aliases:
            return gpu
    return None
