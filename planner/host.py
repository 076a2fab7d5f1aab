"""Host time of a layer pass: what the CPU spends issuing a layer's kernels, by implementation.

A GPU runs a layer no faster than its host can issue the layer's kernels. In eager mode
megatron-core's layers are Python modules that launch dozens of kernels per pass (norms, linear
layers, rotary embedding, attention, activation, residual adds, the autograd functions around
them), so a fast GPU with small micro-batches waits for its host; Transformer Engine fuses some
of those kernels, and CUDA graphs replay a whole captured layer with one launch. The cost model
charges a layer pass max(host seconds, device seconds): eager launches are asynchronous, so the
host issues the next kernels while the device runs the previous ones, and whichever is slower
sets the pace (the overlap the eager runtime gets; the backward runs in autograd's engine thread
with the same bound). Host time is per micro-batch and does not grow with the micro-batch size,
which is why larger micro-batches help a host-bound GPU.

The layer implementation is an explicit parameter of the device costs (`LayerImpl`): the plan's
`training.transformer_impl`, and whether layers run as CUDA graphs. Every figure names its
source; a figure without a GPU measurement behind it says that it is a stated assumption.
A CPU node has no separate host: its measured or catalog times already hold the dispatch.

Pure Python, no planner imports beyond the implementation names.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from planner.cuda_graphs import PLAN_DEFAULT_GRAPH_IMPL
from planner.transformer_impl import PLAN_DEFAULT_IMPL, TRANSFORMER_IMPLS


class LayerImpl(NamedTuple):
    """How a layer is run: megatron-core's layer spec (`local` or `transformer_engine`, the
    plan's `training.transformer_impl`) and whether its passes replay as CUDA graphs."""

    transformer_impl: str = PLAN_DEFAULT_IMPL
    cuda_graphs: bool = False


# what a plan means without a CUDA-graph setting: its transformer_impl's layers, run eagerly
EAGER_LOCAL = LayerImpl()


def layer_impl(
    transformer_impl: str, cuda_graph_impl: str, cuda_graph_scope: Sequence[str]
) -> LayerImpl:
    """The LayerImpl of a plan's `training` settings. Only whole-layer graphs (no scope) count
    as graphed: with a scope, the rest of each layer is issued eagerly, and its host time is
    not measured yet, so such a layer is charged the eager host time (an upper bound)."""
    graphed = cuda_graph_impl != PLAN_DEFAULT_GRAPH_IMPL and not cuda_graph_scope
    return LayerImpl(transformer_impl, graphed)


class HostCosts(NamedTuple):
    """Host seconds per layer pass and micro-batch, forward and backward (a recomputed layer's
    backward also repeats the forward's), plus one launch per pass under CUDA graphs."""

    fwd_s: float
    bwd_s: float
    launch_s: float
    source: str

    def layer_pass(self, recompute: bool) -> tuple[float, float]:
        """(forward, backward) host seconds of one layer pass of one micro-batch."""
        fwd = self.fwd_s + self.launch_s
        bwd = self.bwd_s + self.launch_s
        return fwd, bwd + fwd if recompute else bwd


# Measured on one H200 box (16 host cores, torch 2.11, megatron-core 0.16.1, bf16) with
# megatron-core's local layer spec, eager, and the runtime's default fusions: first from a
# profile of the GPU check's bf16 case (about 2.2 ms forward and 1.8 ms backward per layer
# pass), then fitted to every host-bound step the GPU check has measured (docs/benchmarks.md,
# "GPU check": 11 median steps of four runs, the 270M model's bf16, distributed-optimizer and
# recompute plans and the 1.1B model's eight micro-batches of one sample, docs/results/gpu/):
# 4.3 ms per layer pass and micro-batch, split as the profile split it, is the figure whose
# largest error over those steps is least (20 %; 4.0 ms gave 26 %, 4.66 ms, the 1.1B model's
# alone, 30 %). Those steps vary by up to a third from run to run. Later GPU runs (hexi-profile
# writes `host` into a device profile) replace it.
HOST_LOCAL_EAGER = HostCosts(
    2.4e-3,
    1.9e-3,
    0.0,
    "measured: H200 GPU check, local spec, eager, default fusions (docs/benchmarks.md)",
)

# Stated assumption, no GPU measurement yet: Transformer Engine's layers are issued by the same
# megatron-core Python modules (its fused LayerNorm + linear and attention modules replace the
# local ones one for one), so its host time per pass is taken as the local spec's until a GPU
# run of the TE case measures it.
HOST_TE_EAGER = HOST_LOCAL_EAGER._replace(
    source="stated assumption: the local spec's measured host time (no TE measurement yet)"
)

# Stated assumption: with CUDA graphs a captured layer pass is one graph launch
# (cudaGraphLaunch), on the order of 10 us of host time, whatever the layer's kernel count; the
# Python around the graphs is not measured yet.
GRAPH_LAUNCH_S = 10e-6
HOST_GRAPHED = HostCosts(
    0.0, 0.0, GRAPH_LAUNCH_S, "stated assumption: one 10 us graph launch per layer pass"
)

_BY_IMPL = {
    LayerImpl("local", False): HOST_LOCAL_EAGER,
    LayerImpl("transformer_engine", False): HOST_TE_EAGER,
    LayerImpl("local", True): HOST_GRAPHED,
    LayerImpl("transformer_engine", True): HOST_GRAPHED,
}
assert {k.transformer_impl for k in _BY_IMPL} == set(TRANSFORMER_IMPLS)


def host_costs(impl: LayerImpl) -> HostCosts:
    """The catalog's host costs of a layer implementation (every GPU: the host, not the device,
    issues the kernels)."""
    return _BY_IMPL[LayerImpl(impl.transformer_impl, bool(impl.cuda_graphs))]


__all__ = [
    "LayerImpl",
    "EAGER_LOCAL",
    "layer_impl",
    "HostCosts",
    "HOST_LOCAL_EAGER",
    "HOST_TE_EAGER",
    "HOST_GRAPHED",
    "host_costs",
]
