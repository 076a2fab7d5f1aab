"""Cost model: FLOPs, collective times, stage times and memory of one GPU, from first principles.

Every number the planner predicts is built from the formulas here and the named constants below.
There are no fudge factors: each constant is a published figure, a measurement (a device profile),
or a stated assumption that says so. Units: seconds, bytes, FLOPs, bytes/s.

Notation (Megatron's): b micro-batch size, s sequence length, h hidden size, a attention heads,
g query groups, d head size (kv_channels), f FFN hidden size, V vocabulary, L layers, t the TP
degree. FLOP formulas live in planner/flops.py, parameter counts in planner/layout.py.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

from planner.attention import PLAN_DEFAULT_BACKEND, keeps_scores, unfused_attention_times
from planner.catalog import get_gpu
from planner.errors import SpecError
from planner.flops import attention_flops, head_flops, mlp_flops
from planner.host import EAGER_LOCAL, HostCosts, LayerImpl, host_costs
from planner.kernels import KernelDevice, PassTimes
from planner.kernels import attention_times as kernel_attention_times
from planner.kernels import head_times as kernel_head_times
from planner.kernels import mlp_times as kernel_mlp_times
from planner.layout import stage_params
from planner.profile import MeasuredCosts, ProfiledDevice, attach, read_profile

if TYPE_CHECKING:
    from planner.cluster import ClusterSpec
    from planner.models import ModelSpec

# ------------------------------------------------------------------------------------- constants

BF16_BYTES = 2
FP32_BYTES = 4

# Sustained fraction of catalog peak for the GEMM-dominated mix of a transformer layer (matmuls,
# attention, memory-bound norms and activations). Stated assumption: Megatron-LM reports 52-56 %
# model-FLOPs utilisation on A100 at scale with communication mostly hidden (Narayanan et al. 2021,
# 163 of 312 TFLOP/s; Korthikanti et al. 2022, Table 5), i.e. about 0.55 of peak for the compute
# itself. Catalog GPUs' layers and LM head are timed kernel by kernel instead (planner.kernels);
# this rate times the CPU row and weighs devices against each other in the search's heuristics.
# A measured device profile (`profile:` in the cluster file) replaces both.
SUSTAINED_FRACTION_OF_PEAK = 0.55

# Memory per parameter in megatron-core bf16 mixed precision with Adam (Megatron's DDP keeps fp32
# main grads): bf16 weight 2 + fp32 grad 4 + fp32 master weight 4 + fp32 Adam m and v 8 = 18.
WEIGHT_BYTES_PER_PARAM = BF16_BYTES
GRAD_BYTES_PER_PARAM = FP32_BYTES  # gradient buffers are fp32 on GPU, also for the reduce
OPTIMIZER_BYTES_PER_PARAM = 3 * FP32_BYTES  # fp32 master + Adam exp_avg + exp_avg_sq

# Bytes of GPU memory traffic per parameter in one Adam step (memory-bound): read fp32 grad (4),
# read+write master (8), m (8), v (8), write the bf16 weight copy (2). Counted from the update.
ADAM_STEP_BYTES_PER_PARAM = 30

# Memory the framework takes before any tensor: CUDA context with cuBLAS/NCCL workspaces (~0.5-1 GB
# as reported by nvidia-smi for a PyTorch process) plus caching-allocator fragmentation. Stated
# assumption, one value for every device.
FRAMEWORK_RESERVE_BYTES = 1.5e9

# Attention follows the plan's `training.attention_backend` (planner.attention): an unfused one
# (megatron-core's DotProductAttention) keeps the s x s softmax output, its dropout mask and the
# dropout output for backward, the 5as/h term below, and moves its s x s tensors through device
# memory (planner.attention.unfused_attention_times, with its sourced byte counts); a fused one
# (scaled_dot_product_attention's flash or memory-efficient kernel) keeps neither and is timed by
# its FLOPs alone.

# Korthikanti et al. 2022 (Reducing Activation Recomputation in Large Transformer Models), Sec. 4.1,
# activation bytes per layer without sequence parallelism: s*b*h*(34 + 5*a*s/h). Split into the
# part every TP rank stores (10: norms' inputs, QKV and fc1 inputs, dropout masks), the part split
# over TP by attention heads (8 + 5as/h: Q, K, V, softmax terms, projection input) and the part
# split by FFN columns. Their 16 sbh MLP term is a GeLU MLP with F = 4h: fc1 output and GeLU
# output, 2 bf16 tensors of [s, b, F] = 4 bytes per FFN column per token. A SwiGLU MLP keeps fc1's
# gate and up outputs, SiLU(gate) and the product that enters fc2: 8 bytes per FFN column per
# token (the gap showed as 25% too little activation memory against the runtime's saved tensors).
#
# Sequence parallelism (the plan's `training.sequence_parallel`, in every stage of TP degree t > 1;
# Korthikanti et al. 2022, Sec. 4.2.2): the regions outside attention and MLP (norms, dropouts)
# hold this rank's s/t of the sequence, so the 10 sbh every TP rank stored becomes 10 sbh / t and
# a layer keeps s*b*h*(34/t + 5as/(ht)) (their eq. 4). With full recompute the kept layer input
# is cut the same way. A layer's time is unchanged: each of its TP all-reduces becomes a
# reduce-scatter plus an all-gather of the same total volume (same paper and section), which
# `ring_allreduce_time` already charges (2(t-1)/t bytes and 2(t-1) hops per rank either way). What
# does change is at stage boundaries: the received activation needs no all-gather
# (`boundary_times`).
ACT_REPLICATED = 10  # divided by the sequence split under sequence parallelism
ACT_ATTENTION_SHARDED = 8
ACT_MLP_BYTES_PER_FFN_COLUMN = {False: 4, True: 8}  # by swiglu
ACT_SCORES_PER_AS_OVER_H = 5  # unfused attention only (planner.attention.keeps_scores)

# Vocabulary-parallel cross entropy: three small all-reduces of [s, b] fp32 in forward (max,
# sum of exp, target logit), megatron-core's tensor_parallel.cross_entropy.
CROSS_ENTROPY_ALLREDUCES = 3


# Topology.sig: per rank list, its runs of ranks on one node as (node signature, the node's
# first-appearance number, ranks in the run).
Signature: TypeAlias = tuple[tuple[tuple[int | str, int, int], ...], ...]
# boundary_times: ((transfer, gather) forward, (transfer, gather) backward) seconds.
BoundaryTimes: TypeAlias = tuple[tuple[float, float], tuple[float, float]]


# --------------------------------------------------------------------------------------- devices


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
    fields are optional overrides. A detailed profile (hexi-profile) is used as planner/profile.py
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


# ----------------------------------------------------------------------------------- collectives


def ring_allreduce_time(nbytes: float, n: int, bw: float, lat: float) -> float:
    """Ring all-reduce of `nbytes` over n ranks: 2(n-1)/n * bytes / bw + 2(n-1) latency hops."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * lat


def ring_allgather_time(nbytes: float, n: int, bw: float, lat: float) -> float:
    """Ring all-gather rebuilding a `nbytes` tensor from n equal parts: (n-1)/n bytes/bw +
    (n-1) latency hops."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) / n * nbytes / bw + (n - 1) * lat


def ring_reduce_scatter_time(nbytes: float, n: int, bw: float, lat: float) -> float:
    """Ring reduce-scatter of `nbytes` over n ranks: same volume as an all-gather."""
    return ring_allgather_time(nbytes, n, bw, lat)


class Topology:
    """Fast link look-ups for the cost model: GPU -> node, slowest pair of a rank set.

    Wraps ClusterSpec.link (bandwidth and latency between two GPUs on named nodes) with caches, so
    that the search can ask for thousands of rank sets. Assumption: GPUs of one machine share its
    NIC; concurrent collectives of different groups do not slow each other.
    """

    def __init__(self, cluster: ClusterSpec):
        self.cluster = cluster
        self.nodes = cluster.nodes
        self.node_of: list[int] = []  # rank (cluster order) -> node index
        self.local_of: list[int] = []
        for i, n in enumerate(self.nodes):
            self.node_of.extend([i] * n.gpus_per_node)
            self.local_of.extend(range(n.gpus_per_node))
        self.group_of = [n.group for n in self.nodes]
        self.node_names = {n.name for n in self.nodes}
        group_names = {g.name for g in cluster.groups}
        self._by_name_override = any(
            x in self.node_names and x not in group_names
            for lk in cluster.links
            for x in lk.between
        )
        groups = {g.name: g for g in cluster.groups}
        self.devices = [
            device_for(n.gpu, groups[n.group].profile, n.gpus_per_node) for n in self.nodes
        ]
        self.nic = [n.nic_bw for n in self.nodes]
        self._link: dict[tuple[Any, ...], tuple[float, float]] = {}
        self._slowest: dict[tuple[int, ...], tuple[float, float]] = {}
        self._resources: dict[tuple[int, ...], tuple[int, ...]] = {}

    def device_of(self, rank: int) -> Device:
        return self.devices[self.node_of[rank]]

    def node_sig(self, n: int) -> int | str:
        """What the cost model sees of node n: its group (devices, intra link, NIC), or the node
        itself when links name single machines."""
        return n if self._by_name_override else self.group_of[n]

    def sig(self, *rank_lists: Iterable[int]) -> Signature:
        """Cost signature of one or more rank lists (e.g. a TP group, or both sides of a stage
        boundary): per rank its node's signature and the node's first-appearance number. Rank
        lists with equal signatures have equal costs (devices, links, NICs, shards), so caches
        keyed by it serve identical machines and identical pipelines once."""
        seen: dict[int, int] = {}
        out: list[tuple[tuple[int | str, int, int], ...]] = []
        node_of, by_name, group_of = self.node_of, self._by_name_override, self.group_of
        for ranks in rank_lists:
            run: list[tuple[int | str, int, int]] = []
            last: int | None = None
            count = 0
            for r in ranks:
                n = node_of[r]
                if n != last:
                    if last is not None:
                        run.append((last if by_name else group_of[last], seen[last], count))
                    if n not in seen:
                        seen[n] = len(seen)
                    last, count = n, 0
                count += 1
            if last is not None:
                run.append((last if by_name else group_of[last], seen[last], count))
            out.append(tuple(run))
        return tuple(out)

    def node_link(self, i: int, j: int) -> tuple[float, float]:
        """(bytes/s, s) between GPUs on node indices i and j (i == j: inside the machine)."""
        key = (i, j) if i <= j else (j, i)
        got = self._link.get(key)
        if got is None:
            a, b = self.nodes[key[0]], self.nodes[key[1]]
            if not self._by_name_override and i != j:
                gkey = ("g", a.group, b.group) if a.group <= b.group else ("g", b.group, a.group)
                got = self._link.get(gkey)
                if got is None:
                    got = self.cluster.link(a.name, b.name)
                    # same group pair but different nodes: depends only on the groups
                    self._link[gkey] = got
            else:
                # inside a machine, without per-node links: depends on the group only
                ikey = ("i", a.group) if not self._by_name_override else None
                got = self._link.get(ikey) if ikey else None
                if got is None:
                    got = self.cluster.link(a.name, b.name)
                    prof = self.devices[i].profile if i == j else None
                    if prof is not None and prof.profile.link:  # measured inside the node
                        got = prof.profile.link
                    if ikey:
                        self._link[ikey] = got
            self._link[key] = got
        return got

    def slowest(self, ranks: Iterable[int]) -> tuple[float, float]:
        """(bandwidth, latency) of the slowest pair in a set of ranks: a ring runs at its pace."""
        key = ranks if isinstance(ranks, tuple) else tuple(ranks)
        got = self._slowest.get(key)
        if got is None:
            if len(self._slowest) > 100_000:
                self._slowest.clear()
            got = self._slowest[key] = self._slowest_uncached(key)
        return got

    def resources(self, ranks: tuple[int, ...]) -> tuple[int, ...]:
        """What a collective over `ranks` occupies (planner.gradsync's overlap model): the NIC of
        every machine it touches (resource = node index), or, inside one machine, that machine's
        intra-node link (resource = number of nodes + node index)."""
        got = self._resources.get(ranks)
        if got is None:
            if len(self._resources) > 100_000:
                self._resources.clear()
            nodes = sorted(set(map(self.node_of.__getitem__, ranks)))
            got = tuple(nodes) if len(nodes) > 1 else (len(self.nodes) + nodes[0],)
            self._resources[ranks] = got
        return got

    def _slowest_uncached(self, ranks: tuple[int, ...]) -> tuple[float, float]:
        nodes = Counter(map(self.node_of.__getitem__, ranks))
        bw, lat = float("inf"), 0.0
        if self._by_name_override:
            items = list(nodes)
            pairs = [(n, n) for n, c in nodes.items() if c > 1]
            pairs += [
                (items[x], items[y]) for x in range(len(items)) for y in range(x + 1, len(items))
            ]
        else:  # links depend on groups only: one or two representative nodes per group
            rep: dict[str, list[int]] = {}
            multi: dict[str, int] = {}
            for n, c in nodes.items():
                g = self.group_of[n]
                rep.setdefault(g, []).append(n)
                if c > 1:
                    multi.setdefault(g, n)
            pairs = [(n, n) for n in multi.values()]
            reps = [(v[0], v[1] if len(v) > 1 else None) for v in rep.values()]
            pairs += [(x[0], x[1]) for x in reps if x[1] is not None]
            pairs += [
                (reps[x][0], reps[y][0]) for x in range(len(reps)) for y in range(x + 1, len(reps))
            ]
        for x, y in pairs:
            b, t = self.node_link(x, y)
            if b < bw:
                bw = b
            if t > lat:
                lat = t
        if bw == float("inf"):
            return float("inf"), 0.0
        return bw, lat


def p2p_transfer_time(
    nbytes: float, senders: Sequence[int], receivers: Sequence[int], topo: Topology
) -> float:
    """Time to move a flat buffer from a TP=a stage to a TP=b stage, as the runtime does it.

    The buffer is partitioned evenly over the a senders and evenly over the b receivers; every
    (sender i, receiver j) pair whose parts overlap sends the intersection, all pairs in parallel.
    Time = the slowest pair (bytes/bw + latency), or a machine's NIC carrying all its inter-node
    bytes (out of the sending machine or into the receiving one), whichever is larger.
    """
    a, b = len(senders), len(receivers)
    out_bytes: dict[int, float] = {}
    in_bytes: dict[int, float] = {}
    worst = 0.0
    for i, s in enumerate(senders):
        lo_i, hi_i = nbytes * i / a, nbytes * (i + 1) / a
        j0 = int(lo_i * b // nbytes) if nbytes else 0
        for j in range(j0, b):
            lo_j, hi_j = nbytes * j / b, nbytes * (j + 1) / b
            if lo_j >= hi_i:
                break
            part = min(hi_i, hi_j) - max(lo_i, lo_j)
            if part <= 0:
                continue
            r = receivers[j]
            ns, nr = topo.node_of[s], topo.node_of[r]
            if s == r:
                continue
            bw, lat = topo.node_link(ns, nr)
            worst = max(worst, part / bw + lat)
            if ns != nr:
                out_bytes[ns] = out_bytes.get(ns, 0.0) + part
                in_bytes[nr] = in_bytes.get(nr, 0.0) + part
    for n, v in list(out_bytes.items()) + list(in_bytes.items()):
        worst = max(worst, v / topo.nic[n])
    return worst


def boundary_times(
    m: ModelSpec,
    mbs: int,
    senders: Sequence[int],
    receivers: Sequence[int],
    topo: Topology,
    sequence_parallel: bool = False,
) -> BoundaryTimes:
    """(forward, backward) seconds per micro-batch across one stage boundary.

    Forward: activation [s, b, h] bf16 split-sent senders -> receivers, then an all-gather inside
    the receiving TP group (if b > 1). Backward mirrors it: gradients go receivers -> senders, then
    the senders all-gather. Returns ((transfer_f, gather_f), (transfer_b, gather_b)).

    `sequence_parallel` (the plan's): a stage of TP degree > 1 holds its rank's part of the
    sequence, which is exactly its part of the split-sent buffer (s leads the layout), so the
    runtime leaves the all-gathers out (megatron_hexi.communicator); the transfers are the same.
    """
    nbytes = m.seq_length * mbs * m.hidden_size * BF16_BYTES
    tf = p2p_transfer_time(nbytes, senders, receivers, topo)
    tb = p2p_transfer_time(nbytes, receivers, senders, topo)
    if sequence_parallel:
        return (tf, 0.0), (tb, 0.0)
    gf = ring_allgather_time(nbytes, len(receivers), *topo.slowest(receivers))
    gb = ring_allgather_time(nbytes, len(senders), *topo.slowest(senders))
    return (tf, gf), (tb, gb)


# ------------------------------------------------------------------------------- shards, stages


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
            return kernel_attention_times(dev.kernels, self.m, mbs, query_groups)
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

    def extra(self, mbs: int, vocab: Sequence[int], first: bool) -> tuple[float, float]:
        """(fwd, bwd) a stage adds beyond its layers, embedding and head: nothing here."""
        return 0.0, 0.0


def group_costs(
    m: ModelSpec,
    devices: Sequence[Device],
    tp_link: tuple[float, float],
    attention_backend: str = PLAN_DEFAULT_BACKEND,
    layer_impl: LayerImpl = EAGER_LOCAL,
) -> AnalyticCosts | MeasuredCosts:
    """The cost source of one TP group, chosen once: measured times (planner.profile) when a
    device carries a detailed profile, else FLOPs and ring collectives (`AnalyticCosts`). Both
    answer layer_times, embedding_times, head_times and extra. `attention_backend`: the plan's;
    an unfused one adds its score traffic wherever a layer is timed from FLOPs. `layer_impl`:
    how layers run (planner.host), which sets the host time of a layer pass timed from FLOPs
    (a measured layer time holds its own)."""
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
    xf, xb = costs.extra(mbs, shards["vocab"], first)  # measured: embedding compute, overhead
    fwd, bwd, compute = fwd + xf, bwd + xb, compute + xf + xb
    return StageCost(cf, tf, fwd, bwd, compute, tp, wait)


# ---------------------------------------------------------------------------------------- memory


def layer_activation_bytes(
    m: ModelSpec,
    mbs: int,
    qg: int,
    ffn: int,
    recompute: bool,
    attention_backend: str = PLAN_DEFAULT_BACKEND,
    *,
    sequence_split: int = 1,
) -> float:
    """Bytes one layer keeps for backward per in-flight micro-batch on a rank (Korthikanti 2022).

    s*b*h*(10/σ + 8*qg/g) + s*b*ffn*(8 SwiGLU | 4 GeLU) [+ 5*a*s^2*b*qg/g with an unfused
    attention backend]: the published s*b*h*(34/t + 5as/(ht)) (GeLU, F = 4h) with the TP-sharded
    terms scaled by this rank's share and the MLP term per FFN column. σ = `sequence_split`: the
    ranks the sequence is cut over outside attention and MLP (the stage's TP degree under
    sequence parallelism, else 1); it divides only the replicated 10 sbh, as the other terms are
    this rank's heads and FFN columns already. With full recompute only the layer input
    [s, b, h] bf16 is kept, its s/σ positions under sequence parallelism.
    """
    if sequence_split < 1:
        raise ValueError(f"sequence_split: must be a positive integer, got {sequence_split}")
    s, h, a = m.seq_length, m.hidden_size, m.num_attention_heads
    sbh = s * mbs * h
    if recompute:  # a whole layer input stays an int, as before sequence parallelism
        kept = sbh * BF16_BYTES
        return kept if sequence_split == 1 else kept / sequence_split
    qf = qg / m.num_query_groups
    act = sbh * (ACT_REPLICATED / sequence_split + ACT_ATTENTION_SHARDED * qf)
    act += s * mbs * ffn * ACT_MLP_BYTES_PER_FFN_COLUMN[m.swiglu]
    if keeps_scores(attention_backend):
        act += ACT_SCORES_PER_AS_OVER_H * a * s * s * mbs * qf
    return act


def sequence_split(tp_degree: int, sequence_parallel: bool) -> int:
    """Ranks a stage's sequence is cut over (layer_activation_bytes' `sequence_split`): its TP
    degree under the plan's sequence parallelism, else 1 (a TP-1 stage holds the whole
    sequence)."""
    return tp_degree if sequence_parallel and tp_degree > 1 else 1


def in_flight_microbatches(position: int, num_stages: int, num_microbatches: int) -> int:
    """Micro-batches whose activations stage `position` (0-based) holds at once under 1F1B."""
    return min(num_stages - position, num_microbatches)


@dataclass(frozen=True)
class MemoryUse:
    """Bytes on one GPU, by term; `total` is what must fit in the device's memory."""

    weights: float
    grads: float
    optimizer: float
    activations: float
    logits: float
    reserve: float

    @property
    def total(self) -> float:
        return (
            self.weights
            + self.grads
            + self.optimizer
            + self.activations
            + self.logits
            + self.reserve
        )

    def terms(self) -> dict[str, float]:
        return {
            "weights": self.weights,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "logits": self.logits,
            "reserve": self.reserve,
        }


@dataclass(frozen=True)
class RankShape:
    """What memory depends on besides the model and the layer count: one rank's shards, its
    stage's place in the pipeline, the schedule and the options (rank_memory, layers_that_fit)."""

    mbs: int
    query_groups: int  # this rank's shards
    ffn: int
    vocab: int
    first: bool  # the stage holds the embedding
    last: bool  # the stage holds the output layer and the loss
    position: int  # the stage's index in its pipeline
    num_stages: int
    num_microbatches: int
    recompute: bool
    optimizer_fraction: float = 1.0  # share of fp32 master + Adam state (distributed optimizer)
    attention_backend: str = PLAN_DEFAULT_BACKEND  # the plan's (planner.attention)
    # ranks the sequence is cut over outside attention and MLP: the stage's TP degree under the
    # plan's sequence parallelism, else 1 (layer_activation_bytes)
    sequence_split: int = 1


def rank_memory(m: ModelSpec, shape: RankShape, n_layers: int) -> MemoryUse:
    """MemoryUse of one rank holding `n_layers` layers. `shape.optimizer_fraction` is its share
    of its fp32 master + Adam state (1 without the distributed optimizer).

    Activations: `in_flight_microbatches` x layers x `layer_activation_bytes`; with recompute, plus
    one layer's full activations for the micro-batch being recomputed; both with the shape's
    `sequence_split`. Logits: the last stage keeps [s, b, V_rank] fp32 for one micro-batch (its
    backward follows its forward at once; the output layer gathers the whole sequence, so
    sequence parallelism leaves them as they are).
    """
    r = shape
    params = stage_params(m, r.query_groups, r.ffn, r.vocab, n_layers, r.first, r.last)
    inflight = in_flight_microbatches(r.position, r.num_stages, r.num_microbatches)
    backend, split = r.attention_backend, r.sequence_split
    per_layer = layer_activation_bytes(
        m, r.mbs, r.query_groups, r.ffn, r.recompute, backend, sequence_split=split
    )
    act = inflight * n_layers * per_layer
    if r.recompute:
        act += layer_activation_bytes(
            m, r.mbs, r.query_groups, r.ffn, False, backend, sequence_split=split
        )
    logits = m.seq_length * r.mbs * r.vocab * FP32_BYTES if r.last else 0.0
    return MemoryUse(
        params * WEIGHT_BYTES_PER_PARAM,
        params * GRAD_BYTES_PER_PARAM,
        params * OPTIMIZER_BYTES_PER_PARAM * r.optimizer_fraction,
        act,
        logits,
        FRAMEWORK_RESERVE_BYTES,
    )


def layers_that_fit(capacity: float, m: ModelSpec, shape: RankShape) -> int:
    """The most layers a rank of this shape can hold within `capacity` bytes by `rank_memory`
    (0 when not even the stage's embedding / head fits). The search's memory limit per stage."""

    def total(n: int) -> float:
        return rank_memory(m, shape, n).total

    empty = total(0)
    if empty > capacity:
        return 0
    n = int((capacity - empty) // (total(1) - empty))  # memory is linear in the layers
    while n > 0 and total(n) > capacity:  # rounding: settle on rank_memory
        n -= 1
    while total(n + 1) <= capacity:
        n += 1
    return n


def optimizer_step_time(params: float, mem_bw: float) -> float:
    """Adam step of `params` parameters: memory-bound, ADAM_STEP_BYTES_PER_PARAM bytes each."""
    return params * ADAM_STEP_BYTES_PER_PARAM / mem_bw
