"""The measured cost source: a TP group's times from its devices' detailed profiles.

`MeasuredCosts` answers planner.costmodel.CostSource for a group in which a device carries a
detailed profile (planner.costmodel.group_costs chooses it once per group); planner/profiles.py
only reads and interpolates the profile files. Here are also the per-step overhead a profiled
device adds (`step_overhead`) and the one-line report of which figures each device used
(`cost_sources`, printed by `hexi-plan simulate`).

Attention backend (the plan's `training.attention_backend`): a measured layer time is taken as
it was measured, whichever attention the profiling run used; an unfused backend's s x s traffic
(planner/attention.unfused_attention_times) is added only to layers timed from FLOPs (a device
without a detailed profile, or one measured for another model). Memory follows the plan's
backend everywhere.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from planner.attention import PLAN_DEFAULT_BACKEND, keeps_scores, unfused_attention_times
from planner.flops import attention_flops, head_flops, mlp_flops
from planner.host import EAGER_LOCAL, LayerImpl, host_costs
from planner.kernels import attention_times as kernel_attention_times
from planner.kernels import mlp_times as kernel_mlp_times

if TYPE_CHECKING:
    from planner.devices import Device
    from planner.models import ModelSpec
    from planner.profiles import DeviceProfile
    from planner.topology import Topology

# A profile times eager layer passes. Where the host's part of a pass (until the forward or
# backward call returned) is this share of the measured pass or more, the pass was host-bound
# and the device's own time is hidden in it: a plan with whole-layer CUDA graphs (one launch a
# pass) is charged the kernel model's device time there instead, at most the measured time. On
# one H200 (docs/results/gpu/profiles/) the host's share was 99 % of every forward pass of one
# or two samples, 98-99 % of the 270M model's backward passes and 79 % of the 1.1B model's
# (whose device backward outlasts its host), and 46 % and 17 % at eight samples.
HOST_BOUND_SHARE = 0.9


class MeasuredCosts:
    """Per micro-batch costs of a TP group in which a device carries a detailed profile.

    Each device's source is chosen once, here: its profile where it was measured for this model,
    else FLOPs at its sustained rate (a profile of another model gives only `matmul_tflops`).
    The group waits for its slowest device. Collectives follow the first profiled device's
    measurements (in-situ TP runs, the all-reduce curve or its fit).
    """

    def __init__(
        self,
        m: ModelSpec,
        devices: Sequence[Device],
        tp_link: Sequence[float],
        attention_backend: str = PLAN_DEFAULT_BACKEND,
        layer_impl: LayerImpl = EAGER_LOCAL,
    ):
        self.m, self.devices, self.tp_link = m, devices, tuple(tp_link)
        # a GPU whose layers are timed from FLOPs waits for its host: the host time its
        # profile measured (eager runs), else the catalog's for the implementation
        self.host = [
            None
            if d.name == "CPU" or (d.profile is not None and d.profile.profile.is_cpu)
            else d.profile.profile.host
            if d.profile is not None and d.profile.profile.host and not layer_impl.cuda_graphs
            else host_costs(layer_impl)
            for d in devices
        ]
        # an unfused backend's score traffic is added where a layer is timed from FLOPs; a
        # measured layer time holds whatever its attention moved
        self.unfused = keeps_scores(attention_backend)
        self.measured = [
            d.profile if d.profile is not None and d.profile.profile.matches(m) else None
            for d in devices
        ]
        self.comm = next(d.profile.profile for d in devices if d.profile is not None)
        self.graph_launch = host_costs(layer_impl) if layer_impl.cuda_graphs else None

    def layer_times(
        self, mbs: int, qg: Sequence[int], ffn: Sequence[int], recompute: bool
    ) -> tuple[float, float, float, float]:
        """(compute_fwd, tp_comm_fwd, compute_bwd, tp_comm_bwd) of one layer."""
        m = self.m
        g, f = m.num_query_groups, m.ffn_hidden_size
        cf = cb = 0.0
        least_f = least_b = math.inf  # the least loaded rank's compute
        for q, x, dev, pd, host in zip(qg, ffn, self.devices, self.measured, self.host):
            if pd is not None:
                s = pd.profile.share(q / g, x / f)
                fwd_field = pd.profile.fwd_recompute_field if recompute else "fwd_s"
                fw = pd.profile.layer(fwd_field, s, mbs) * pd.slowdown
                bw = (
                    pd.profile.layer("bwd_recompute_s" if recompute else "bwd_s", s, mbs)
                    * pd.slowdown
                )
                host_rows = None if pd.profile.is_cpu else pd.profile.layer_host
                if self.graph_launch is not None and host_rows is not None:
                    hf = host_rows("host_fwd_s", s, mbs)
                    hb = host_rows("host_bwd_s", s, mbs) + (hf if recompute else 0.0)
                    fw, bw = self._graphed(dev, q, x, mbs, recompute, (fw, bw), (hf, hb))
            else:
                fw, bw = self._device_pass(dev, q, x, mbs, recompute, kernels=False)
                if host is not None:  # a pass lasts at least its host time (planner.host)
                    hf, hb = host.layer_pass(recompute)
                    fw, bw = max(fw, hf), max(bw, hb)
            cf, cb = max(cf, fw), max(cb, bw)
            least_f, least_b = min(least_f, fw), min(least_b, bw)
        t, prof = len(self.devices), self.comm
        if t > 1 and prof.in_situ_tp(m, t, self.tp_link):
            # the in-situ runs are even: on a GPU their comm holds the wait for a partner's
            # jitter, which a rank with less to compute than the slowest absorbs (it waits
            # anyway); on a CPU node it absorbs nothing (`skew_absorbed` says why)
            field = "bwd_recompute_s" if recompute else "bwd_s"
            tf, tb = prof.tp_comm("fwd_s", mbs), prof.tp_comm(field, mbs)
            ready = None if prof.is_cpu else prof.tp_ready_allreduce(mbs)
            if ready is not None:
                tf = skew_absorbed(tf, 2 * ready, cf - least_f)
                tb = skew_absorbed(tb, (4 if recompute else 2) * ready, cb - least_b)
            return cf, tf, cb, tb
        ar = tp_allreduce(prof, m, mbs, t, self.tp_link)
        return cf, 2 * ar, cb, (4 if recompute else 2) * ar

    def _device_pass(
        self, dev: Device, q: int, x: int, mbs: int, recompute: bool, *, kernels: bool
    ) -> tuple[float, float]:
        """(forward, backward) device seconds of a rank's layer pass on `q` query groups and `x`
        FFN columns, not measured: kernel by kernel where `kernels` and the device has a kernel
        model, else FLOPs at its sustained rate (backward twice the forward); an unfused
        backend's score traffic added, and the forward again under recompute."""
        m = self.m
        if kernels and dev.kernels is not None:
            a = kernel_attention_times(dev.kernels, m, mbs, q, not self.unfused)
            p = kernel_mlp_times(dev.kernels, m, mbs, x)
            fw, bw = a.fwd + p.fwd, a.bwd + p.bwd
        else:
            g, f = m.num_query_groups, m.ffn_hidden_size
            fw = (attention_flops(m, mbs) * q / g + mlp_flops(m, mbs) * x / f) / dev.flops
            bw = fw * 2
        if self.unfused:
            xf, xb = unfused_attention_times(m, mbs, q, dev.mem_bw)
            fw, bw = fw + xf, bw + xb
        if recompute:
            bw += fw
        return fw, bw

    def _graphed(
        self,
        dev: Device,
        q: int,
        x: int,
        mbs: int,
        recompute: bool,
        measured: tuple[float, float],
        host: tuple[float, float],
    ) -> tuple[float, float]:
        """A profiled rank's (forward, backward) layer pass under whole-layer CUDA graphs, from
        its `measured` eager pass and that pass's `host` part: the measured pass where it was
        device-bound, else the device time of its kernels (`HOST_BOUND_SHARE`) plus one graph
        launch."""
        assert self.graph_launch is not None
        (fw, bw), (hf, hb) = measured, host
        df, db = self._device_pass(dev, q, x, mbs, recompute, kernels=True)
        lf, lb = self.graph_launch.layer_pass(recompute)
        if hf >= HOST_BOUND_SHARE * fw:
            fw = min(fw, df) + lf
        if hb >= HOST_BOUND_SHARE * bw:
            bw = min(bw, db) + lb
        return fw, bw

    def embedding_times(self, mbs: int) -> tuple[float, float]:
        """(fwd, bwd) of the vocab-parallel embedding's communication: the forward all-reduce
        of [s, b, h] (its compute is in `extra`)."""
        return tp_allreduce(self.comm, self.m, mbs, len(self.devices), self.tp_link), 0.0

    def head_times(self, mbs: int, vocab: Sequence[int]) -> tuple[float, float]:
        """(fwd, bwd) of the LM head + loss: measured by vocabulary share where profiled."""
        m = self.m
        cf = cb = 0.0
        for v, dev, pd in zip(vocab, self.devices, self.measured):
            if pd is not None and pd.profile.head is not None:
                share = v / m.vocab_size
                fw = pd.profile.head("fwd_s", share, mbs) * pd.slowdown
                bw = pd.profile.head("bwd_s", share, mbs) * pd.slowdown
            else:
                fw = head_flops(m, mbs) * v / m.vocab_size / dev.flops
                bw = 2 * fw
            cf, cb = max(cf, fw), max(cb, bw)
        t, prof = len(self.devices), self.comm
        small = prof.allreduce(m.seq_length * mbs * 4, t, self.tp_link)
        return cf + 3 * small, cb + tp_allreduce(prof, m, mbs, t, self.tp_link)

    def extra(
        self, mbs: int, vocab: Sequence[int], first: bool, n_layers: int
    ) -> tuple[float, float]:
        """(fwd, bwd) seconds a stage of `n_layers` layers adds per micro-batch: the embedding's
        measured compute (first stage) and its share of the per-micro-batch overhead.

        That overhead is what the profile's one-rank steps of the whole model take per
        micro-batch beyond the planner's prediction of them (runtime_overhead.py). It is charged
        by the stage's share of the layers, not whole to every stage: it holds, besides the
        runtime's own work (about 0.6 ms of loss and data per micro-batch on the bench model),
        whatever the layer grid misses of the whole model's passes, and the machine's drift
        between the grid and the one-rank steps, both of which scale with the layers held.
        Measured on the fidelity bench's model (docs/benchmarks.md): a 2-layer pipeline
        stage's forward matched its layers, embedding and head without it, while the profiles
        read 0-3.6 ms; charged whole to each stage it put PP2 m8 recompute 5-18 points above
        the one-rank plan."""
        ef = eb = over = 0.0
        held = n_layers / self.m.num_layers
        for v, pd in zip(vocab, self.measured):
            if pd is None:
                continue
            over = max(over, pd.profile.per_microbatch_s * pd.slowdown * held)
            if first and pd.profile.embedding is not None:
                share = v / self.m.vocab_size
                ef = max(ef, pd.profile.embedding("fwd_s", share, mbs) * pd.slowdown)
                eb = max(eb, pd.profile.embedding("bwd_s", share, mbs) * pd.slowdown)
        return ef + over, eb


def skew_absorbed(in_situ: float, ready: float, imbalance: float) -> float:
    """A layer pass's TP comm seconds on a group whose slowest rank computes `imbalance` seconds
    longer than its least loaded one, from the comm measured in situ on even shards.

    Stated model (GPU profiles): the even runs' comm is the all-reduces' own cost (`ready`: what
    they take with the partners already waiting, at most the in-situ figure) plus the wait for
    whichever partner ran late (the skew: the rest). A rank with less to compute arrives early
    at every all-reduce, so the slowest rank never waits for it: the skew shrinks by the
    imbalance, down to none.

    On a CPU node it is not applied: an uneven group pays the in-situ comm whole. Timed in
    training on a 2-core VM (five launches of each fidelity-bench plan, 2026-12-05), the busy
    rank of the 3:1 split spent 94-102 ms of its step inside its 87 all-reduce calls,
    asynchronous waits included, as long as the even split's ranks (74-102 ms): about 1.1 ms a
    call, where the same all-reduce with the partner already waiting typically takes 0.5 ms
    (hexi-profile's `allreduce_ready_s`). Re-simulated over ten bench runs, charging the in-situ
    comm whole moved that plan's mean error from -5.1 to +0.3 % and lowered the worst plan's
    error in four runs. Why a busy CPU rank's calls cost as much as a waiting one's is not
    established."""
    base = min(ready, in_situ)
    return base + max(in_situ - base - imbalance, 0.0)


def tp_allreduce(
    prof: DeviceProfile, m: ModelSpec, mbs: int, t: int, tp_link: Sequence[float]
) -> float:
    """Seconds of one TP all-reduce of an activation [s, b, h]: half a layer's in-situ forward
    comm (two all-reduces) where measured for this group, else the all-reduce curve / fit."""
    if t <= 1:
        return 0.0
    if prof.in_situ_tp(m, t, tuple(tp_link)):
        return prof.tp_comm("fwd_s", mbs) / 2
    return prof.allreduce(m.seq_length * mbs * m.hidden_size * prof.act_bytes, t, tuple(tp_link))


def step_overhead(device: Device) -> float:
    """Seconds per iteration the runtime adds on a profiled device (beyond per-parameter Adam)."""
    pd = device.profile
    if pd is None:
        return 0.0
    return (pd.profile.per_step_s + pd.profile.opt_fixed_s) * pd.slowdown


# ------------------------------------------------------------------------------- reporting


def cost_sources(topo: Topology, model: ModelSpec) -> dict[str, str]:
    """{node group: one line saying which figures the cost model used for that device}."""
    out: dict[str, str] = {}
    for node, dev in zip(topo.nodes, topo.devices):
        if node.group in out:
            continue
        if dev.profile is not None:
            pd = dev.profile
            if pd.profile.matches(model):
                parts = ["measured per-layer/head/embedding times"]
                if pd.profile.curves["allreduce"]:
                    parts.append(
                        f"measured {pd.profile.comm_procs}-process comm curves inside the node"
                    )
                if pd.profile.tp_mbs:
                    parts.append(f"in-situ {pd.profile.tp_procs}-way TP layer comm")
                if pd.slowdown != 1.0:
                    parts.append(
                        f"contention x{pd.slowdown:.2f} for {node.gpus_per_node} processes"
                    )
                out[node.group] = f"{dev.name}: profile {pd.profile.path} ({', '.join(parts)})"
            else:
                out[node.group] = (
                    f"{dev.name}: profile {pd.profile.path} measured for another "
                    f"model: matmul_tflops only ({dev.flops / 1e12:.4g} TFLOP/s)"
                )
        elif dev.source.startswith("profile"):
            out[node.group] = f"{dev.name}: {dev.source} (matmul_tflops {dev.flops / 1e12:.4g})"
        else:
            out[node.group] = f"{dev.name}: {dev.source} (no profile)"
    return out
