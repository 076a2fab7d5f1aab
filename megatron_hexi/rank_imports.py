"""The modules a rank process of the runtime imports, named once.

Two places load them ahead of time: the test suite's forkserver (tests/forkserver.py) imports them
once and forks every rank from there, and tools/setup_env.sh imports them, beside the command-line
entry points, to write their bytecode when it sets up an environment. Naming them here imports
nothing: a module missing from the list (renamed, moved) is only imported later, more slowly.
"""

from __future__ import annotations

import importlib.util
import pkgutil

RANK_MODULES = (
    "torch",
    "torch.distributed",
    "megatron.core",
    "megatron.core.parallel_state",
    "megatron.core.models.gpt",
    "megatron.core.optimizer",
    "megatron.core.pipeline_parallel",
    "megatron_hexi.training",
    "megatron_hexi.checkpoint",
    "megatron_hexi.model",
    "megatron_hexi.data",
    "megatron_hexi.gather",
    "megatron_hexi.distributed_optimizer",
    "megatron.core.datasets.gpt_dataset",
    "megatron.core.datasets.blended_megatron_dataset_builder",
    "safetensors.torch",
    "planner.plan",
)


def submodules(package: str) -> list[str]:
    """The modules of a package, found without importing it (megatron_hexi.patches imports
    torch)."""
    spec = importlib.util.find_spec(package)
    assert spec is not None and spec.submodule_search_locations, package
    return [f"{package}.{m.name}" for m in pkgutil.iter_modules(spec.submodule_search_locations)]


def rank_modules() -> list[str]:
    """RANK_MODULES and the patches every CPU rank imports when it patches megatron-core
    (nothing is patched on import)."""
    return [*RANK_MODULES, "megatron_hexi.patches", *submodules("megatron_hexi.patches")]
