"""Measured device profiles (`hexi-profile`) in the cost model: reading and interpolation.

A node group's `profile: path.json` (planner/devices.device_for) may be
- a plain profile: only `matmul_tflops` (+ optional memory figures) replaces the catalog's
  sustained throughput; every time is still FLOPs / throughput;
- a detailed profile (format "hexi-device-profile/1", written by hexi-profile): for the model it
  was measured with (same sizes; the layer count may differ), the cost model uses the measured
  per-layer forward/backward (and recompute backward) times, interpolated piecewise-linearly in the
  rank's shard (FLOP-weighted share of query groups and FFN columns) and in the micro-batch size,
  the measured embedding and LM-head + loss times (by vocabulary share), the runtime's measured
  per-micro-batch and per-step overheads, the optimizer step (fixed + per parameter), and the
  measured all-reduce curve for TP groups inside the profiled node (each point at most the time
  of every larger one; other links inside the node use the ring-model fit of the measured
  curves). A TP group as wide as the profile's in-situ runs (`tp_layer`, inside the profiled
  node) takes its all-reduce cost from those runs instead: the layer over a real group minus the
  compute predicted for its shard, which includes what the all-reduces cost the compute beside
  them; on uneven shards of a GPU profile less the wait for a late partner that the imbalance
  absorbs, down to the measured all-reduce with the partner already waiting (on a CPU node,
  nothing: planner.measured_costs.skew_absorbed says why).
  For another model it falls back to `matmul_tflops`.

CPU contention (stated model): a node of a CPU profile runs `gpus_per_node` processes of `threads`
threads on `cpu_cores` cores. With k processes the compute slows by the measured `contention`
slowdown at the profiled process count (interpolated linearly from 1.0 at one process), and beyond
the cores by a further k x threads / cores (time-slicing). The simulator then counts a process
that computes for part of the step as that part of a process (planner/simulator.py). GPU
profiles get no contention.

How the cost model uses what is read here (a TP group with a profiled device takes all its
costs from it): planner/measured_costs.py.

Pure Python (no torch): the planner must not import torch.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Any, NamedTuple

from planner.errors import SpecError
from planner.flops import attention_fraction
from planner.host import HostCosts
from planner.inputs import is_number, read_json

if TYPE_CHECKING:
    from planner.models import ModelSpec

FORMAT = "hexi-device-profile/1"
_MODEL_KEYS = (
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "vocab_size",
    "seq_length",
    "swiglu",
    "normalization",
    "kv_channels",
    "untie_embeddings_and_output_weights",
)


@lru_cache(maxsize=None)
def read_profile(path: str) -> dict[str, Any]:
    """The JSON of a profile file (plain or detailed), checked for `matmul_tflops`."""
    data = read_json(path, "profile")  # size, UTF-8, nesting, finite numbers
    if (
        not isinstance(data, dict)
        or not is_number(data.get("matmul_tflops"))
        or data["matmul_tflops"] <= 0
    ):
        raise SpecError(f"profile {path}: needs a positive number `matmul_tflops`")
    return data


def is_detailed(data: object) -> bool:
    return isinstance(data, dict) and data.get("format") == FORMAT and bool(data.get("layer"))


class _ProfiledModel(NamedTuple):
    """The model a profile was measured with, as the FLOP formulas read it (from its JSON)."""

    seq_length: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    swiglu: bool

    @classmethod
    def of(cls, m: Mapping[str, Any]) -> _ProfiledModel:
        h, a = m["hidden_size"], m["num_attention_heads"]
        return cls(
            m["seq_length"],
            h,
            a,
            m["num_query_groups"],
            m.get("kv_channels") or h // a,
            m["ffn_hidden_size"],
            m.get("swiglu", True),
        )


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through (xs, ys) (sorted, distinct); outside the measured range (or
    with a single point) proportional to the nearest end point (time ~ work)."""
    if x >= xs[-1] or len(xs) == 1:
        return ys[-1] * x / xs[-1] if xs[-1] else ys[-1]
    if x <= xs[0]:
        return ys[0] * x / xs[0] if xs[0] else ys[0]
    i = bisect_left(xs, x)
    i = min(max(i, 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    y = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return max(y, 0.0)


def _column(rows: Sequence[Mapping[str, Any]], key: str) -> list[float] | None:
    """Each row's `key`, or None where the rows are empty or one lacks it (a profile written
    before the field was measured)."""
    if not rows or any(r.get(key) is None for r in rows):
        return None
    return [float(r[key]) for r in rows]


def _never_faster_when_larger(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """A measured (bytes, seconds) collective curve, sorted, each point at most the time of
    every larger one. A collective of fewer bytes over the same group is never slower: a point
    above a larger one is a slow call (each is timed from a barrier, and a partner that left it
    late is waited for). Example, the fidelity bench's CPU profile of 2026-12-04: 2.59 ms for
    1 KiB against 0.34 ms for 4 KiB; charged three times per micro-batch (the vocab-parallel
    loss's small all-reduces), it put both TP plans 31 ms (10 %) above their measured steps."""
    out = sorted(points)
    for i in range(len(out) - 2, -1, -1):
        out[i] = (out[i][0], min(out[i][1], out[i + 1][1]))
    return out


def _loglog(points: Sequence[tuple[float, float]], x: float) -> float:
    """Interpolate a measured (bytes, seconds) curve in log-log; linear in bytes beyond it."""
    xs = [p[0] for p in points]
    if x <= xs[0]:
        return points[0][1]
    if x >= xs[-1]:
        (xa, ya), (xb, yb) = points[-2], points[-1]
        slope = max((yb - ya) / (xb - xa), 0.0)
        return yb + slope * (x - xb)
    i = bisect_left(xs, x)
    (xa, ya), (xb, yb) = points[i - 1], points[i]
    f = (math.log(x) - math.log(xa)) / (math.log(xb) - math.log(xa))
    return math.exp(math.log(max(ya, 1e-12)) * (1 - f) + math.log(max(yb, 1e-12)) * f)


class _Grid:
    """Times on a (share, micro-batch) grid: interpolate in share per micro-batch size, then in
    micro-batch size."""

    def __init__(
        self,
        rows: Iterable[Mapping[str, Any]],
        share_of: Callable[[Mapping[str, Any]], float],
        fields: Iterable[str],
    ):
        by_mbs: dict[int, dict[float, Mapping[str, Any]]] = {}
        for r in rows:
            by_mbs.setdefault(r["mbs"], {})[share_of(r)] = r
        self.mbs = sorted(by_mbs)
        self.cols: list[tuple[list[float], dict[str, list[float]]]] = []
        for b in self.mbs:
            shares = sorted(by_mbs[b])
            self.cols.append((shares, {f: [by_mbs[b][s][f] for s in shares] for f in fields}))

    def __call__(self, field: str, share: float, mbs: float) -> float:
        ys = []
        for shares, vals in self.cols:
            ys.append(_interp(shares, vals[field], share))
        return _interp(self.mbs, ys, mbs)


class DeviceProfile:
    """A detailed profile, ready for the cost model."""

    def __init__(self, data: dict[str, Any], path: str):
        self.path, self.data = path, data
        self.model = data.get("model", {})
        m = self.model
        self.threads = int(data.get("threads", 1))
        self.cores = int(data.get("cpu_cores", 1) or 1)
        self.is_cpu = data.get("device") == "CPU"
        self.act_bytes = 4 if data.get("dtype") == "float32" else 2
        self._att_frac = attention_fraction(_ProfiledModel.of(m))
        g, f, v = m["num_query_groups"], m["ffn_hidden_size"], m["vocab_size"]
        # the forward under full recompute (no activations saved); profiles written before it
        # was measured: the plain forward
        self.fwd_recompute_field = (
            "fwd_recompute_s" if _column(data["layer"], "fwd_recompute_s") else "fwd_s"
        )
        self.layer = _Grid(
            data["layer"],
            lambda r: self.share(r["query_groups"] / g, r["ffn"] / f),
            ("fwd_s", "bwd_s", "bwd_recompute_s", self.fwd_recompute_field),
        )
        self.embedding = (
            _Grid(data["embedding"], lambda r: r["vocab"] / v, ("fwd_s", "bwd_s"))
            if data.get("embedding")
            else None
        )
        self.head = (
            _Grid(data["head"], lambda r: r["vocab"] / v, ("fwd_s", "bwd_s"))
            if data.get("head")
            else None
        )
        self.host = _host_costs(data["layer"], path)
        # the host's part of each layer row, where every row has it (profiles before it: None)
        self.layer_host: _Grid | None = (
            _Grid(
                data["layer"],
                lambda r: self.share(r["query_groups"] / g, r["ffn"] / f),
                ("host_fwd_s", "host_bwd_s"),
            )
            if self.host is not None
            else None
        )
        rt = data.get("runtime") or {}
        self.per_microbatch_s = float(rt.get("per_microbatch_s", 0.0))
        self.per_step_s = float(rt.get("per_step_s", 0.0))
        opt = data.get("optimizer") or {}
        self.opt_fixed_s = float(opt.get("fixed_s", 0.0))
        self.opt_s_per_param: float | None = opt.get("s_per_param")
        comm = data.get("comm") or {}
        self.comm_procs: int | None = comm.get("procs")
        self.curves: dict[str, list[tuple[float, float]]] = {
            k: _never_faster_when_larger([(p["bytes"], p["s"]) for p in comm.get(k, [])])
            for k in ("allreduce", "allgather", "p2p")
        }
        fit = (comm.get("fit") or {}).get("allreduce")
        self.link: tuple[float, float] | None = (
            (fit["bandwidth_gbs"] * 1e9, fit["latency_us"] * 1e-6) if fit else None
        )
        cont = data.get("contention") or {}
        self.contention_procs: int | None = cont.get("procs")
        self.contention_slowdown = float(cont.get("slowdown", 1.0))
        rows = sorted(data.get("tp_layer") or [], key=lambda r: r["mbs"])
        self.tp_procs: int | None = rows[0]["tp"] if rows else None
        self.tp_mbs: list[int] = [r["mbs"] for r in rows]
        # TP comm = the in-situ layer time beyond this model's own compute estimate for the shard
        # (grid time x contention), so that compute + comm gives back the measured TP layer
        slow = self.contention(rows[0]["tp"]) if rows else 1.0
        self.tp_comm_rows = {
            k: [max(r[k] - self.layer(k, 1.0 / r["tp"], r["mbs"]) * slow, 0.0) for r in rows]
            for k in ("fwd_s", "bwd_s", "bwd_recompute_s")
        }
        # one activation's all-reduce with the partners already in it (profiles before it was
        # measured: None, and the in-situ comm is charged whole)
        self.tp_ready = _column(rows, "allreduce_ready_s")

    def share(self, qf: float, ff: float) -> float:
        """FLOP-weighted share of a layer held by a rank with these query-group / FFN fractions."""
        return self._att_frac * qf + (1 - self._att_frac) * ff

    def matches(self, m: ModelSpec) -> bool:
        mine = self.model
        for k in _MODEL_KEYS:
            if k in mine and getattr(m, k, None) != mine[k]:
                return False
        return True

    @property
    def process_slots(self) -> int:
        """How many processes of `threads` threads the node's cores hold at once."""
        return max(self.cores // max(self.threads, 1), 1)

    def contention(self, procs: float) -> float:
        """Compute slowdown with `procs` processes on the node (1.0 on GPUs)."""
        if not self.is_cpu or procs <= 1:
            return 1.0
        cp, sd = self.contention_procs, self.contention_slowdown
        fit_cores = self.process_slots
        if cp and cp > 1:
            at = 1.0 + (sd - 1.0) * (min(procs, cp) - 1) / (cp - 1)
        else:
            at = 1.0
        if procs > fit_cores:
            at *= procs / fit_cores
        return at

    def in_situ_tp(self, m: ModelSpec, n: int, link: tuple[float, ...]) -> bool:
        """Whether TP comm of model m on an n-way group over `link` comes from the in-situ TP
        layer runs (measured for this model, this width, inside the profiled node)."""
        return bool(self.tp_mbs) and n == self.tp_procs and link == self.link and self.matches(m)

    def tp_comm(self, field: str, mbs: float) -> float:
        """Per-layer seconds the TP all-reduces add to a layer pass ("fwd_s", "bwd_s",
        "bwd_recompute_s"), measured in situ: the layer over a real group minus the compute this
        model predicts for its even shard."""
        return _interp(self.tp_mbs, self.tp_comm_rows[field], mbs)

    def tp_ready_allreduce(self, mbs: float) -> float | None:
        """Seconds of one in-situ TP all-reduce of an activation whose partners already wait in
        it, at this micro-batch size; None where the profile did not measure it."""
        return None if self.tp_ready is None else _interp(self.tp_mbs, self.tp_ready, mbs)

    def allreduce(self, nbytes: float, n: int, link: tuple[float, ...]) -> float:
        """Seconds of an all-reduce of nbytes over n ranks: measured curve inside the node."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        if n == self.comm_procs and self.curves["allreduce"] and link == self.link:
            return _loglog(self.curves["allreduce"], nbytes)
        bw, lat = link
        return 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * lat


class ProfiledDevice:
    """What a Device carries: the profile and the contention of its node."""

    __slots__ = ("profile", "slowdown")

    def __init__(self, profile: DeviceProfile, slowdown: float):
        self.profile, self.slowdown = profile, slowdown


def _host_costs(rows: Sequence[Mapping[str, Any]], path: str) -> HostCosts | None:
    """The host time per layer pass a profile measured (its layer rows' `host_fwd_s` and
    `host_bwd_s`, the fastest over the grid: host time does not grow with the shard or the
    micro-batch), or None for a profile written before hexi-profile measured it."""
    if not rows or not all(is_number(r.get("host_fwd_s")) for r in rows):
        return None
    if not all(is_number(r.get("host_bwd_s")) for r in rows):
        return None
    return HostCosts(
        min(float(r["host_fwd_s"]) for r in rows),
        min(float(r["host_bwd_s"]) for r in rows),
        0.0,
        f"measured: profile {path}",
    )


@lru_cache(maxsize=None)
def _profile_of(path: str) -> DeviceProfile:
    return DeviceProfile(read_profile(path), path)


def attach(data: dict[str, Any], path: str, procs_per_node: int) -> ProfiledDevice | None:
    """ProfiledDevice for a detailed profile, else None."""
    if not is_detailed(data):
        return None
    prof = _profile_of(path)
    return ProfiledDevice(prof, prof.contention(procs_per_node))
