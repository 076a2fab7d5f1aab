"""CUDA graphs: the names a plan records (`training.cuda_graph_impl`, `training.cuda_graph_scope`)
and the rules a plan with graphs must meet.

The names and meanings are megatron-core's (TransformerConfig.cuda_graph_impl and
cuda_graph_scope, Megatron-LM's `--cuda-graph-impl` and `--cuda-graph-scope`):

* `none`: no CUDA graphs (what every plan meant before the field);
* `local`: megatron-core's CudaGraphManager captures each transformer layer's forward and backward
  after a few eager warm-up steps and replays them from then on;
* `transformer_engine`: Transformer Engine's make_graphed_callables captures the layers.

The scope picks what of a layer is captured: absent (or empty) the whole layer, else some of
`attn` and `mlp` (the dense-model scopes; megatron-core's MoE and Mamba scopes do not apply to the
models this project trains). Megatron-core's `full_iteration` scope captures the whole
forward-backward step, which needs a step with no host synchronisation and no collective outside
the graph; this runtime captures per layer only, so a plan cannot ask for it.

Graphs replay fixed kernels on fixed addresses, so megatron-core refuses them with full
activation recompute (outside `full_iteration`), and they cannot run forward pre-hooks other than
megatron-core DDP's: the distributed optimizer's overlapped parameter gather is such a hook. Both
combinations are refused here, when the plan is validated.

Pure Python, no torch: the planner records the choice; the cost model may read it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from planner.inputs import short

# every name a plan or a flag may give, in the order --help lists them
CUDA_GRAPH_IMPLS = ("none", "local", "transformer_engine")
# what a plan without `training.cuda_graph_impl` means: what every plan meant before the field
PLAN_DEFAULT_GRAPH_IMPL = "none"
# the scopes of megatron-core's CudaGraphScope that a dense GPT layer has
CUDA_GRAPH_SCOPES = ("attn", "mlp")


def graph_problems(training: Mapping[str, Any]) -> list[str]:
    """One line per problem with a plan's `training` CUDA-graph fields (each naming its field)."""
    problems = []
    impl = training.get("cuda_graph_impl", PLAN_DEFAULT_GRAPH_IMPL)
    if not isinstance(impl, str) or impl not in CUDA_GRAPH_IMPLS:
        problems.append(
            f"training.cuda_graph_impl: must be one of {', '.join(CUDA_GRAPH_IMPLS)}, "
            f"got {short(impl)}"
        )
        return problems
    scope = training.get("cuda_graph_scope", [])
    if not isinstance(scope, list) or not all(
        isinstance(s, str) and s in CUDA_GRAPH_SCOPES for s in scope
    ):
        full = isinstance(scope, list) and "full_iteration" in scope
        problems.append(
            "training.cuda_graph_scope: "
            + (
                "full_iteration (the whole step in one graph) is not supported by this runtime, "
                "which captures per layer; give attn and/or mlp, or no scope for whole layers"
                if full
                else f"must be a list of {' and '.join(CUDA_GRAPH_SCOPES)} (empty or absent: the "
                f"whole layer), got {short(scope)}"
            )
        )
    elif len(set(scope)) != len(scope):
        problems.append(f"training.cuda_graph_scope: repeats a scope: {short(scope)}")
    elif scope and impl == "none":
        problems.append(
            "training.cuda_graph_scope: given without CUDA graphs (cuda_graph_impl: none)"
        )
    if impl == "none":
        return problems
    if training.get("recompute") is True:
        problems.append(
            f"training.cuda_graph_impl: {impl} graphs cannot capture full activation recompute "
            "(recompute: true); megatron-core allows it only in whole-step capture"
        )
    if training.get("overlap_param_gather") is True:
        problems.append(
            f"training.cuda_graph_impl: {impl} graphs cannot run the overlapped parameter "
            "gather's forward pre-hooks (overlap_param_gather: true)"
        )
    return problems


def describe(impl: str, scope: tuple[str, ...]) -> str:
    """A plan's CUDA graphs in words: 'none', 'local (whole layers)', 'local (attn, mlp)'."""
    if impl == "none":
        return "none"
    return f"{impl} ({', '.join(scope) if scope else 'whole layers'})"


__all__ = [
    "CUDA_GRAPH_IMPLS",
    "PLAN_DEFAULT_GRAPH_IMPL",
    "CUDA_GRAPH_SCOPES",
    "graph_problems",
    "describe",
]
