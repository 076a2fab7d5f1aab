"""Cost model: the per micro-batch times of one TP group and of one stage, from first principles.

Every time the planner predicts is built from the cost sources here (`CostSource`: the analytic
one, `AnalyticCosts`, and the measured one, planner/measured_costs.py), the links
(planner/topology.py) and the named constants. There are no fudge factors: each constant is a
published figure, a measurement (a device profile), or a stated assumption that says so. Memory
lives in planner/memory.py, devices in planner/devices.py. Units: seconds, bytes, FLOPs, bytes/s.

Notation (Megatron's): b micro-batch size, s sequence length, h hidden size, a attention heads,
g query groups, d head size (kv_channels), f FFN hidden size, V vocabulary, L layers, t the TP
degree. FLOP formulas live in planner/flops.py, parameter counts in planner/layout.py.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from planner.attention import PLAN_DEFAULT_BACKEND, keeps_scores, unfused_attention_times
from planner.flops import attention_flops, head_flops, mlp_flops
from planner.host import EAGER_LOCAL, HostCosts, LayerImpl, host_costs
from planner.kernels import PassTimes
from planner.kernels import attention_times as kernel_attention_times
from planner.kernels import head_times as kernel_head_times
from planner.kernels import mlp_times as kernel_mlp_times
from planner.measured_costs import MeasuredCosts
from planner.memory import BF16_BYTES, FP32_BYTES
from planner.topology import ring_allreduce_time

if TYPE_CHECKING:
    from planner.devices import Device
    from planner.models import ModelSpec

# Vocabulary-parallel cross entropy: three small all-reduces of [s, b] fp32 in forward (max,
# sum of exp, target logit), megatron-core's tensor_parallel.cross_entropy.
CROSS_ENTROPY_ALLREDUCES = 3


# ------------------------------------------------------------------------------- shards, stages


class CostSource(Protocol):
    """What the stage costs ask of one TP group's cost source, per micro-batch, in seconds.

    Two sources answer it: `AnalyticCosts` (FLOPs or the kernel model, ring collectives) and
    planner.measured_costs.MeasuredCosts (a device's detailed profile). `group_costs` picks one
    per group. `AnalyticCosts` also splits out the host wait (`layer_split`) and the head's
    communication (`head_split`); a measured time holds both, so the Protocol leaves them out.
    """

    def layer_times(
        self, mbs: int, qg: Sequence[int], ffn: Sequence[int], recompute: bool
    ) -> tuple[float, float, float, float]:
        """(compute_fwd, tp_comm_fwd, compute_bwd, tp_comm_bwd) of one layer with these shards."""
        ...

    def embedding_times(self, mbs: int) -> tuple[float, float]:
        """(fwd, bwd) of the vocab-parallel embedding's communication."""
        ...

    def head_times(self, mbs: int, vocab: Sequence[int]) -> tuple[float, float]:
        """(fwd, bwd) of the LM head + vocab-parallel cross entropy on the last stage."""
        ...

    def extra(
        self, mbs: int, vocab: Sequence[int], first: bool, n_layers: int
    ) -> tuple[float, float]:
        """(fwd, bwd) a stage of `n_layers` layers adds beyond its layers, embedding and head."""
        ...


@dataclass(frozen=True)
class StageCost:
    """Per micro-batch seconds of one stage (TP group) and its parts, for the schedule and reports.

    `layer_fwd`/`layer_bwd` are per transformer layer (compute + TP all-reduces); `fwd`/`bwd` are
    for the whole stage incl. embedding / LM head / cross entropy.
    """

    layer_compute_fwd: float
    layer_tp_fwd: float
    fwd: float
    bwd: float
    compute: float  # fwd + bwd compute only (incl. recompute and the wait for the host)
    tp_comm: float  # fwd + bwd TP all-reduce time
    host_wait: float = 0.0  # the part of `compute` the device waits for its host (planner.host)


class AnalyticCosts:
    """Per micro-batch costs of a TP group from FLOPs at each device's sustained rate and ring
    collectives on the group's slowest link; a layer pass takes at least its host time
    (planner.host) for the layer implementation `layer_impl` on GPUs (a CPU has no separate
    host)."""

    def __init__(
        self,
        m: ModelSpec,
        devices: Sequence[Device],
        tp_link: tuple[float, float],
        attention_backend: str = PLAN_DEFAULT_BACKEND,
        layer_impl: LayerImpl = EAGER_LOCAL,
    ):
        self.m, self.devices, self.tp_link = m, devices, tp_link
        self.unfused = keeps_scores(attention_backend)
        self.host: HostCosts | None = host_costs(layer_impl)
        if any(d.name == "CPU" for d in devices):
            self.host = None

    def layer_times(
        self, mbs: int, qg: Sequence[int], ffn: Sequence[int], recompute: bool
    ) -> tuple[float, float, float, float]:
        """(compute_fwd, tp_comm_fwd, compute_bwd, tp_comm_bwd) of one layer (`layer_split`)."""
        return self.layer_split(mbs, qg, ffn, recompute)[:4]

    def layer_split(
        self, mbs: int, qg: Sequence[int], ffn: Sequence[int], recompute: bool
    ) -> tuple[float, float, float, float, float, float]:
        """(compute_fwd, tp_comm_fwd, compute_bwd, tp_comm_bwd, host_wait_fwd, host_wait_bwd)
        of one layer; the compute includes the host wait.

        Each TP rank computes its share: attention for its query groups, the MLP for its FFN
        columns (kernel by kernel on a catalog GPU, planner.kernels; else FLOPs at the
        device's sustained rate); the group waits for the slowest rank at each of the two
        all-reduces per pass (after attention and after the MLP, [s, b, h] bf16 each).
        Backward = 2 x forward compute and 2 all-reduces; full recompute adds one forward
        (compute and its all-reduces) to backward. Unfused attention adds its score traffic
        (`unfused_attention_times`) to each rank's attention share. A pass lasts at least its
        host time: where the device (compute + TP all-reduces) is faster, the compute is
        lengthened by the wait for the host (host_wait).
        """
        m, devices = self.m, self.devices
        t = len(devices)
        ar = ring_allreduce_time(m.seq_length * mbs * m.hidden_size * BF16_BYTES, t, *self.tp_link)
        tf = tb = 2 * ar
        att_f = att_b = mlp_f = mlp_b = 0.0
        for q, x, dev in zip(qg, ffn, devices):
            a, p = self._attention(dev, mbs, q), self._mlp(dev, mbs, x)
            if self.unfused:
                xf, xb = unfused_attention_times(m, mbs, q, dev.mem_bw)
                a = PassTimes(a.fwd + xf, a.bwd + xb)
            att_f, att_b = max(att_f, a.fwd), max(att_b, a.bwd)
            mlp_f, mlp_b = max(mlp_f, p.fwd), max(mlp_b, p.bwd)
        cf, cb = att_f + mlp_f, att_b + mlp_b
        if recompute:
            cb, tb = cb + cf, tb + tf
        wf = wb = 0.0
        if self.host is not None:
            hf, hb = self.host.layer_pass(recompute)
            wf, wb = max(0.0, hf - tf - cf), max(0.0, hb - tb - cb)
        return cf + wf, tf, cb + wb, tb, wf, wb

    def _attention(self, dev: Device, mbs: int, query_groups: int) -> PassTimes:
        """A rank's attention block: kernel by kernel on a catalog GPU, else its FLOPs at the
        device's sustained rate (backward twice the forward)."""
        if dev.kernels is not None:
            return kernel_attention_times(dev.kernels, self.m, mbs, query_groups, not self.unfused)
        c = attention_flops(self.m, mbs) * query_groups / self.m.num_query_groups / dev.flops
        return PassTimes(c, 2 * c)

    def _mlp(self, dev: Device, mbs: int, columns: int) -> PassTimes:
        """A rank's MLP block, timed as `_attention`."""
        if dev.kernels is not None:
            return kernel_mlp_times(dev.kernels, self.m, mbs, columns)
        c = mlp_flops(self.m, mbs) * columns / self.m.ffn_hidden_size / dev.flops
        return PassTimes(c, 2 * c)

    def embedding_times(self, mbs: int) -> tuple[float, float]:
        """(fwd, bwd) of the vocab-parallel embedding: one all-reduce of [s, b, h] in forward."""
        m = self.m
        return (
            ring_allreduce_time(
                m.seq_length * mbs * m.hidden_size * BF16_BYTES, len(self.devices), *self.tp_link
            ),
            0.0,
        )

    def head_times(self, mbs: int, vocab: Sequence[int]) -> tuple[float, float]:
        """(fwd, bwd) of the LM head + vocab-parallel cross entropy on the last stage
        (`head_split`'s compute and communication together)."""
        cf, tf, cb, tb = self.head_split(mbs, vocab)
        return cf + tf, cb + tb

    def head_split(self, mbs: int, vocab: Sequence[int]) -> tuple[float, float, float, float]:
        """(compute_fwd, comm_fwd, compute_bwd, comm_bwd) of the LM head + vocab-parallel cross
        entropy on the last stage.

        Compute per rank in proportion to its vocabulary rows (2*b*s*h*V forward, 2x backward;
        kernel by kernel on a catalog GPU, with the cross entropy's passes over the logits);
        forward adds CROSS_ENTROPY_ALLREDUCES all-reduces of [s, b] fp32, backward one
        all-reduce of the input gradient [s, b, h] bf16 (the head is column-parallel).
        """
        m, devices, link = self.m, self.devices, self.tp_link
        hf = head_flops(m, mbs)
        cf = cb = 0.0
        for v, dev in zip(vocab, devices):
            if dev.kernels is not None:
                p = kernel_head_times(dev.kernels, mbs * m.seq_length, m.hidden_size, v)
            else:
                c = hf * v / m.vocab_size / dev.flops
                p = PassTimes(c, 2 * c)
            cf, cb = max(cf, p.fwd), max(cb, p.bwd)
        t = len(devices)
        small = ring_allreduce_time(m.seq_length * mbs * FP32_BYTES, t, *link)
        big = ring_allreduce_time(m.seq_length * mbs * m.hidden_size * BF16_BYTES, t, *link)
        return cf, CROSS_ENTROPY_ALLREDUCES * small, cb, big

    def extra(
        self, mbs: int, vocab: Sequence[int], first: bool, n_layers: int
    ) -> tuple[float, float]:
        """(fwd, bwd) a stage adds beyond its layers, embedding and head: nothing here."""
        return 0.0, 0.0


def group_costs(
    m: ModelSpec,
    devices: Sequence[Device],
    tp_link: tuple[float, float],
    attention_backend: str = PLAN_DEFAULT_BACKEND,
    layer_impl: LayerImpl = EAGER_LOCAL,
) -> CostSource:
    """The cost source of one TP group, chosen once: measured times (MeasuredCosts) when a
    device carries a detailed profile, else FLOPs and ring collectives (`AnalyticCosts`).
    `attention_backend`: the plan's; an unfused one adds its score traffic wherever a layer is
    timed from FLOPs. `layer_impl`: how layers run (planner.host), which sets the host time of
    a layer pass timed from FLOPs (a measured layer time holds its own)."""
    if any(d.profile is not None for d in devices):
        return MeasuredCosts(m, devices, tp_link, attention_backend, layer_impl)
    return AnalyticCosts(m, devices, tp_link, attention_backend, layer_impl)


def stage_cost(
    m: ModelSpec,
    mbs: int,
    devices: Sequence[Device],
    shards: Mapping[str, Sequence[int]],
    n_layers: int,
    first: bool,
    last: bool,
    tp_link: tuple[float, float],
    recompute: bool,
    attention_backend: str = PLAN_DEFAULT_BACKEND,
    layer_impl: LayerImpl = EAGER_LOCAL,
) -> StageCost:
    """StageCost of a stage holding `n_layers` layers (+ embedding if first, + head if last)."""
    costs = group_costs(m, devices, tp_link, attention_backend, layer_impl)
    wait = 0.0
    if isinstance(costs, AnalyticCosts):
        cf, tf, cb, tb, wf, wb = costs.layer_split(
            mbs, shards["query_groups"], shards["ffn"], recompute
        )
        wait = n_layers * (wf + wb)
    else:
        cf, tf, cb, tb = costs.layer_times(mbs, shards["query_groups"], shards["ffn"], recompute)
    fwd, bwd = n_layers * (cf + tf), n_layers * (cb + tb)
    compute, tp = n_layers * (cf + cb), n_layers * (tf + tb)
    if first:
        ef, eb = costs.embedding_times(mbs)
        fwd, bwd, tp = fwd + ef, bwd + eb, tp + ef + eb
    if last:
        if isinstance(costs, AnalyticCosts):
            hcf, htf, hcb, htb = costs.head_split(mbs, shards["vocab"])
        else:  # measured: split by the head's FLOPs at the device's rate
            hf, hb = costs.head_times(mbs, shards["vocab"])
            hcf = max(
                head_flops(m, mbs) * v / m.vocab_size / dev.flops
                for v, dev in zip(shards["vocab"], devices)
            )
            hcb, htf, htb = 2 * hcf, hf - hcf, hb - 2 * hcf
        fwd, bwd = fwd + hcf + htf, bwd + hcb + htb
        compute, tp = compute + hcf + hcb, tp + htf + htb
    xf, xb = costs.extra(mbs, shards["vocab"], first, n_layers)  # measured: embedding, overhead
    fwd, bwd, compute = fwd + xf, bwd + xb, compute + xf + xb
    return StageCost(cf, tf, fwd, bwd, compute, tp, wait)
