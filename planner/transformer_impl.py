"""Transformer implementations: the names a plan records (`training.transformer_impl`) and the
default the planning commands choose.

The names are Megatron-LM's `--transformer-impl` choices. `transformer_engine` builds each
stage from megatron-core's Transformer Engine layer spec (TE's fused LayerNorm + linear layers,
its attention); `local` from megatron-core's local spec (torch layers, with the core attention
planner.attention names). Both take the same per-rank TransformerConfig, which gives each rank
its uneven shard, so a plan's layout means the same under either.

The cost model charges both alike: the same FLOPs at the device's sustained fraction of peak,
the same host time per layer pass (planner.host: TE's is stated as the local spec's until a GPU
run measures it), the same activations (TE's attention is one of the fused backends; its
LayerNorm + linear keeps the norm's output as the local pair does), the same TP collectives.
The plan records the choice so that a run is the run that was planned; a profile measured with
the local spec stands for both.

Pure Python, no imports of torch or of Transformer Engine: `te_installed` only asks whether the
package could be imported where the plan is made.
"""

from __future__ import annotations

import importlib.util

# every name a plan or a flag may give, in the order --help lists them
TRANSFORMER_IMPLS = ("transformer_engine", "local")
# what a plan without `training.transformer_impl` means: what every plan meant before the field
PLAN_DEFAULT_IMPL = "local"
TE_PACKAGE = "transformer_engine"


def te_installed() -> bool:
    """Whether Transformer Engine is installed in this Python (found, not imported)."""
    return importlib.util.find_spec(TE_PACKAGE) is not None


def default_impl(gpu_cluster: bool) -> str:
    """What `hexi-plan` and the start-up planning choose when --transformer-impl is not given:
    Megatron-LM's default, `transformer_engine`, for a cluster of GPUs where TE is installed;
    otherwise `local` (CPU nodes cannot run TE, and without TE the local spec is what runs)."""
    return "transformer_engine" if gpu_cluster and te_installed() else "local"


__all__ = [
    "TRANSFORMER_IMPLS",
    "PLAN_DEFAULT_IMPL",
    "TE_PACKAGE",
    "te_installed",
    "default_impl",
]
