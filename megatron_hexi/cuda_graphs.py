"""CUDA graphs in the runtime: what the plan's `training.cuda_graph_impl` and `cuda_graph_scope`
(planner.cuda_graphs) turn into in megatron-core.

`local` graphs are megatron-core's own: with `TransformerConfig.cuda_graph_impl = "local"` every
TransformerLayer gets a CudaGraphManager, runs eagerly for `cuda_graph_warmup_steps` steps while
it records the order of its forward and backward passes, and megatron-core's pipeline schedule
captures all of them at the end of that step (`create_cudagraphs`); later steps replay them. Three
things must be true for that, and this module makes them so:

* the RNG tracker is graph-safe (`use_cudagraphable_rng`, or TE's tracker): dropout inside a
  captured layer draws from generator states the graph registers;
* megatron-core's global pipeline size is the stage's pipeline depth: the manager reuses one set
  of graphs for every micro-batch only when there is no pipelining (micro-batches run one at a
  time), and keeps one per in-flight micro-batch otherwise; and its global pipeline rank is the
  stage's, because each graph runner asks megatron-core's layer-offset helpers (which read that
  rank when no process group is given) whether its layer is the first or last of the stage;
* the run is on CUDA: the check refuses anything else before a process group exists.

`transformer_engine` graphs (TE's make_graphed_callables, driven by megatron-core's
TECudaGraphHelper) need Megatron-LM's global micro-batch calculator and a DDP-wrapped model, which
this runtime does not have: the check refuses them after checking that TE could be imported, so
the plan's choice is kept and a run says why it cannot follow it. The whole-step scope
(`full_iteration`) is refused when the plan is validated.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from planner.cuda_graphs import PLAN_DEFAULT_GRAPH_IMPL
from planner.errors import SpecError
from planner.transformer_impl import TE_PACKAGE

if TYPE_CHECKING:
    from megatron.core.transformer import TransformerConfig

    from planner.plan import Training


def check_cuda_graphs(impl: str, cuda: bool) -> None:
    """SpecError unless this process can capture the plan's CUDA graphs (`impl`): CUDA for any,
    and for `transformer_engine` an importable Transformer Engine. Called before any process
    group, as check_transformer_impl is."""
    if impl == PLAN_DEFAULT_GRAPH_IMPL:
        return
    fix = "re-plan with hexi-plan ... --cuda-graph-impl none"
    if not cuda:
        raise SpecError(
            f"the plan's training.cuda_graph_impl is {impl}: CUDA graphs run on CUDA only, and "
            f"this run is on the CPU: {fix} to run the plan on CPU processes"
        )
    if impl != "transformer_engine":
        return
    try:
        __import__(TE_PACKAGE + ".pytorch")
    except Exception as e:  # noqa: BLE001 - any failure to import it (missing, ABI) is the same
        raise SpecError(
            "the plan's training.cuda_graph_impl is transformer_engine, but Transformer Engine "
            f"cannot be imported here ({type(e).__name__}: {e}); install it or re-plan with "
            "hexi-plan ... --cuda-graph-impl local"
        ) from e
    raise SpecError(
        "the plan's training.cuda_graph_impl is transformer_engine, which this runtime does not "
        "capture yet (megatron-core's TECudaGraphHelper needs Megatron-LM's global micro-batch "
        "calculator and DDP model); re-plan with hexi-plan ... --cuda-graph-impl local"
    )


def config_fields(training: Training) -> dict[str, Any]:
    """The TransformerConfig fields of the plan's CUDA graphs (megatron-core's names): the
    implementation, and the scope as megatron-core's list of scope names (empty: whole layers).
    Nothing when the plan has none, so the config stays megatron-core's default."""
    if training.cuda_graph_impl == PLAN_DEFAULT_GRAPH_IMPL:
        return {}
    return {
        "cuda_graph_impl": training.cuda_graph_impl,
        "cuda_graph_scope": list(training.cuda_graph_scope),
    }


def rng_tracker_options(impl: str) -> dict[str, bool]:
    """model_parallel_cuda_manual_seed's tracker options for the plan's CUDA graphs: a graph-safe
    tracker whenever graphs are captured (megatron-core's CudaGraphManager asserts it), TE's own
    tracker for TE's graphs; megatron-core's plain tracker otherwise."""
    graphs = impl != PLAN_DEFAULT_GRAPH_IMPL
    return {"te_rng_tracker": impl == "transformer_engine", "use_cudagraphable_rng": graphs}


class PipelineDepth(Protocol):
    """What set_megatron_globals reads of a rank's view (a planner.plan.RankView, or the
    profiler's stand-alone stage view)."""

    @property
    def stage(self) -> int: ...

    @property
    def num_stages(self) -> int: ...


def set_megatron_globals(config: TransformerConfig, view: PipelineDepth) -> None:
    """Before a stage with local graphs is built: megatron-core's global pipeline size, which
    CudaGraphManager reads to decide whether one set of graphs serves every micro-batch (it does
    only without pipelining), and pipeline rank, which each graph runner reads through
    get_transformer_layer_offset (the stage's config is a one-stage pipeline, so its layers are
    numbered from 1 within the stage whatever the rank)."""
    if config.cuda_graph_impl != "local":
        return
    from megatron.core import parallel_state

    parallel_state.set_pipeline_model_parallel_world_size(view.num_stages)
    parallel_state.set_pipeline_model_parallel_rank(view.stage)


__all__ = [
    "PipelineDepth",
    "check_cuda_graphs",
    "config_fields",
    "rng_tracker_options",
    "set_megatron_globals",
]
