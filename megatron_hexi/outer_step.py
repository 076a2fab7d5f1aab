"""The outer step of islands (DiLoCo): every `interval` inner steps, average each island's
parameter change over the islands and apply the outer optimizer (planner.islands states the
rules; this module follows them in tensor form).

Each rank keeps, for the canonical ranges it represents (planner.outer_traffic: one holder per
island and range), the outer parameters theta_outer (fp32) and the outer momentum. At an outer
step of fragment f it takes Delta_k = theta_outer - theta_k from the optimizer's fp32 main
parameters, exchanges it with the other islands' representatives (fp32 all-reduce of
tokens-weighted values, or an all-gather of bf16 / block-int8 values summed in fp32 in island
order), applies `sgd` or `nesterov`, and hands the new theta_outer to the range's other holders
in its island (a broadcast), which write it into their model parameters and fp32 main
parameters. With one fragment this runs right after the H-th inner update and blocks; with
several the exchange starts after step s and lands before step s + 1's optimizer update
(`land`, called from the gradient finalize), which then applies to the landed parameters.

Under the distributed optimizer the outer state is sharded like the masters: the ranges are also
cut where any island's master parts end (planner.outer_traffic), each is represented in each
island by the owner of its master part, which reads Delta from and writes the result into that
master; the optimizer's all-gather then hands it to the island's other holders (after the step's
own all-gather with one fragment, at the next step's with several). That needs the masters cut
from one gradient bucket per rank set, as the planner cuts them (no bucket bound).

Collectives: one group per representatives' rank set and one per island holder set, created at
start-up on every rank in one order; at an outer step every rank issues the cross-island
collectives of its buckets (in the global range order), then the hand-offs (same order), so
every rank's sequence is a subsequence of one global order, as in megatron_hexi.grad_sync. Every
group carries the run's distributed timeout.
"""

from __future__ import annotations

import datetime
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megatron_hexi.arguments import OUTER_SHARDED_NEEDS_RANK_SET_BUCKETS
from megatron_hexi.process_groups import group_order
from planner.errors import SpecError
from planner.islands import INT8_BLOCK, outer_bytes_sent, syncs_after_step
from planner.outer_traffic import outer_ranges

if TYPE_CHECKING:
    from megatron_hexi.process_groups import HeteroGroups
    from planner.layout import ParamShard
    from planner.outer_traffic import OuterRange
    from planner.plan import Plan


@dataclass
class _Held:
    """A canonical range as this rank holds it: a slice of a local parameter and of its fp32
    main parameter."""

    index: int  # position in outer_ranges
    range: OuterRange
    param: torch.Tensor
    main: torch.Tensor
    start: int  # along the segment's dim, in the local parameter

    def view(self, t: torch.Tensor) -> torch.Tensor:
        seg = self.range.segment
        return t.narrow(seg.dim, self.start, seg.end - seg.start)


@dataclass
class _Bucket:
    """Ranges moved by one collective over `ranks` (None group: this rank alone)."""

    ranks: tuple[int, ...]
    group: dist.ProcessGroup | None
    held: list[_Held] = field(default_factory=list)


@dataclass
class _InFlight:
    """A fragment's exchange started: per cross bucket, the buffers and the handles."""

    fragment: int
    buffers: list[list[torch.Tensor]]
    works: list[list[dist.Work]]


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of INT8_BLOCK values, each with an fp32 scale max|x| / 127; values rounded half to
    even (planner.islands). Returns (int8 values [n], scales [ceil(n / INT8_BLOCK)])."""
    n = x.numel()
    blocks = math.ceil(n / INT8_BLOCK)
    padded = torch.nn.functional.pad(x.reshape(-1), (0, blocks * INT8_BLOCK - n))
    rows = padded.view(blocks, INT8_BLOCK)
    scales = rows.abs().amax(dim=1) / 127
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(rows / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.reshape(-1)[:n], scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    n = q.numel()
    padded = torch.nn.functional.pad(q.float(), (0, scales.numel() * INT8_BLOCK - n))
    return (padded.view(-1, INT8_BLOCK) * scales[:, None]).reshape(-1)[:n]


def main_params(optimizer: Any) -> dict[int, torch.Tensor]:
    """{id(model parameter): the fp32 tensor the optimizer updates (itself in fp32 training)}."""
    if hasattr(optimizer, "float16_groups"):
        out = {}
        for g16, g32 in zip(optimizer.float16_groups, optimizer.fp32_from_float16_groups):
            out.update({id(a): b for a, b in zip(g16, g32)})
        for group in optimizer.fp32_from_fp32_groups:
            out.update({id(a): a for a in group})
        return out
    return {id(p): p for g in optimizer.param_groups for p in g["params"]}


def _regather(optimizer: Any) -> None:
    """The distributed optimizer's all-gather of the masters, after any still in flight."""
    optimizer.finish_param_gather()
    optimizer.all_gather_params()


def island_weights(plan: Plan) -> list[float]:
    """tokens_k / tokens of each island: its pipelines' samples over the global batch."""
    return [
        sum(plan.pipelines[p].num_samples for p in pipes) / plan.global_batch_size
        for pipes in plan.island_pipelines()
    ]


class OuterStep:
    """This rank's part of the outer step; does nothing for a plan without `training.outer`."""

    def __init__(
        self,
        plan: Plan,
        groups: HeteroGroups,
        params: Sequence[tuple[ParamShard, torch.nn.Parameter]],
        optimizer: Any,
        timeout: datetime.timedelta,
    ) -> None:
        """`optimizer`: the run's megatron-core optimizer, built (its fp32 main parameters are
        where Delta is read and the result written); under the distributed optimizer, its master
        parts, which must come from unbounded buckets (one per rank set): then they are cut as
        planner.outer_traffic cuts them."""
        self.settings = plan.training.outer
        self.rank, self.launch_of = rank, launch_of = groups.plan_rank, groups.launch_of
        self.world = plan.world_size
        self.island = plan.rank_view(rank).island
        self.weights = island_weights(plan)
        self.pending: list[_InFlight] = []  # exchanges in flight
        self.landed: list[int] = []  # fragments whose outer step is taken, not yet written
        self.held: list[_Held] = []  # the canonical ranges this rank holds
        # the distributed optimizer's all-gather: it hands the masters' new values on
        self.regather: Callable[[], None] | None = None
        self.bytes = 0  # sent across islands this iteration
        self.seconds = 0.0  # blocked in the outer step this iteration
        self.fragments_run: list[int] = []  # fragments whose exchange started this iteration
        self.outer: dict[int, torch.Tensor] = {}  # range index -> theta_outer (fp32)
        self.momentum: dict[int, torch.Tensor] = {}
        self.cross: list[list[_Bucket]] = []  # per fragment, this rank's, in global order
        self.hand: list[list[_Bucket]] = []
        if self.settings is None:
            return
        ranges = outer_ranges(plan)
        held = self.held
        if plan.training.use_distributed_optimizer:
            # the ranges this rank's master parts hold: it represents each in its island
            if optimizer.grad_sync.bucket_size is not None:
                raise SpecError(OUTER_SHARDED_NEEDS_RANK_SET_BUCKETS)
            for i, r in enumerate(ranges):
                if r.representatives[self.island] != rank:
                    continue
                seg = r.segment
                part = next(
                    p
                    for p in optimizer.parts
                    if p.name == seg.name
                    and p.global_start <= seg.start
                    and seg.end <= p.global_start + p.length
                )
                held.append(_Held(i, r, part.master, part.master, seg.start - part.global_start))
            self.regather = partial(_regather, optimizer)
        else:
            by_name = {shard.name: p for shard, p in params}
            main_of = main_params(optimizer)
            for i, r in enumerate(ranges):
                mine = [ls for rk, ls in r.segment.members if rk == rank]
                if mine:  # a tied pair on one stage is one parameter: its first slice
                    p = by_name[r.segment.name]
                    held.append(_Held(i, r, p, main_of[id(p)], mine[0]))
        # every rank creates every group, in one order: cross-island sets, then island sets
        cross_keys = dict.fromkeys(r.representatives for r in ranges if len(r.representatives) > 1)
        hand_keys = dict.fromkeys(h for r in ranges for h in r.holders if len(h) > 1)
        made: dict[tuple[str, tuple[int, ...]], dist.ProcessGroup] = {}
        for kind, keys in (("cross", cross_keys), ("hand", hand_keys)):
            for key in keys:
                g = dist.new_group(sorted(launch_of[r] for r in key), timeout=timeout)
                if rank in key:
                    made[kind, key] = g
        fragments = self.settings.fragments
        self.cross = [self._buckets(held, f, "cross", made) for f in range(fragments)]
        self.hand = [self._buckets(held, f, "hand", made) for f in range(fragments)]
        with torch.no_grad():
            for h in held:
                if h.range.representatives[self.island] == rank:
                    value = h.view(h.main).detach().float()
                    value = value.clone(memory_format=torch.contiguous_format)
                    self.outer[h.index] = value
                    self.momentum[h.index] = torch.zeros_like(value)

    def _buckets(
        self,
        held: Sequence[_Held],
        fragment: int,
        kind: str,
        groups: Mapping[tuple[str, tuple[int, ...]], dist.ProcessGroup],
    ) -> list[_Bucket]:
        """This rank's buckets of `fragment`: ranges with one rank set share one buffer, in the
        order of each set's first range (the same on every member)."""
        out: dict[tuple[int, ...], _Bucket] = {}
        for h in held:
            r = h.range
            if r.fragment != fragment:
                continue
            if kind == "cross":
                if r.representatives[self.island] != self.rank:
                    continue
                key = r.representatives
            else:
                key = r.holders[self.island]
            if key not in out:
                out[key] = _Bucket(key, groups.get((kind, key)), [])
            out[key].held.append(h)
        return list(out.values())

    # -- the schedule ------------------------------------------------------------------------
    def after_update(self, step: int) -> None:
        """After inner step `step`'s (1-based) optimizer update: start the exchange of every
        fragment due; with one fragment, land it at once."""
        self.bytes, self.seconds, self.fragments_run = 0, 0.0, []
        if self.settings is None:
            return
        began = time.perf_counter()
        for f in range(self.settings.fragments):
            if syncs_after_step(step, f, self.settings):
                self.pending.append(self._launch(f))
                self.fragments_run.append(f)
        if self.settings.fragments == 1 and self.pending:
            self._land()
            if self.regather is not None:  # the step's own all-gather ran before the outer step
                self.regather()
        self.seconds += time.perf_counter() - began

    def land(self) -> None:
        """Write the result of every exchange started after the last step into the parameters
        (called before the optimizer update; with fragments, their exchange lands here)."""
        if self.pending or self.landed:
            began = time.perf_counter()
            self._land()
            self.seconds += time.perf_counter() - began

    @torch.no_grad()
    def finish_exchanges(self) -> list[int]:
        """Wait for every exchange in flight and take its outer step (theta_outer, momentum);
        its parameters are written at the next `land`. Returns the fragments so waiting: a
        checkpoint saves them with the outer state, and the resumed run writes them where this
        one would."""
        pending, self.pending = self.pending, []
        for flight in pending:
            for b, bufs, works in zip(self.cross[flight.fragment], flight.buffers, flight.works):
                for w in works:
                    w.wait()
                self._apply(b, self._average(b, bufs))
            self.landed.append(flight.fragment)
        return list(self.landed)

    @torch.no_grad()
    def _land(self) -> None:
        self.finish_exchanges()
        landed, self.landed = self.landed, []
        for fragment in landed:
            self._hand_off(fragment)

    # -- checkpoints -------------------------------------------------------------------------
    def saved_ranges(self) -> list[tuple[str, int, int, dict[str, torch.Tensor]]]:
        """What this rank writes of the outer state: (name, dim, start, {kind: tensor}) of the
        ranges it represents in island 0 (theta_outer and the momentum are the same in every
        island, so each range is written once). Call `finish_exchanges` first."""
        return [
            (
                h.range.segment.name,
                h.range.segment.dim,
                h.range.segment.start,
                {"outer_param": self.outer[h.index], "outer_momentum": self.momentum[h.index]},
            )
            for h in self.held
            if h.index in self.outer and self.island == 0
        ]

    @torch.no_grad()
    def restore(
        self, read: Callable[[str, _Held, torch.Tensor], None] | None, landed: list[int]
    ) -> None:
        """Fill theta_outer and the momentum of every range this rank represents (`read(kind,
        held range, out)` reads a canonical range into `out`), and the fragments whose result
        waits to be written (`finish_exchanges`). `read` None: start afresh from the fp32 main
        parameters as they are now (loaded weights), momentum zero."""
        for h in self.held:
            if h.index in self.outer and read is None:
                self.outer[h.index].copy_(h.view(h.main))
                self.momentum[h.index].zero_()
            elif h.index in self.outer and read is not None:
                for kind, t in (("outer_param", self.outer), ("outer_momentum", self.momentum)):
                    value = torch.empty(t[h.index].shape, dtype=torch.float32)
                    read(kind, h, value)
                    t[h.index].copy_(value)
        self.landed = list(landed)

    def metrics(self, device: torch.device) -> dict[str, Any]:
        """This iteration's outer-step fields (none without `training.outer`): whether it ran
        (one fragment) or which fragment(s) started, the bytes each plan rank sent across
        islands, and the longest time a rank was blocked in it. One small all-reduce."""
        if self.settings is None:
            return {}
        per_rank = torch.zeros(2, self.world, dtype=torch.float64, device=device)
        per_rank[0, self.rank], per_rank[1, self.rank] = self.bytes, self.seconds
        dist.all_reduce(per_rank)
        sent, seconds = per_rank.tolist()
        runs = self.fragments_run
        if self.settings.fragments == 1:
            ran: Any = bool(runs)
        else:
            ran = runs[0] if len(runs) == 1 else (runs or None)
        return {
            "outer_step": ran,
            "outer_sync_bytes": [int(b) for b in sent],
            "outer_sync_exposed_s": max(seconds),
        }

    # -- the exchange ------------------------------------------------------------------------
    @torch.no_grad()
    def _launch(self, fragment: int) -> _InFlight:
        assert self.settings is not None
        comp, k = self.settings.compression, len(self.weights)
        buffers: list[list[torch.Tensor]] = []
        works: list[list[dist.Work]] = []
        for b in self.cross[fragment]:
            deltas = [self.outer[h.index] - h.view(h.main).float() for h in b.held]
            flat = torch.cat([d.reshape(-1) for d in deltas])
            if b.group is None:  # one island: nothing crosses
                buffers.append([flat])
                works.append([])
                continue
            self.bytes += sum(outer_bytes_sent(h.range.numel, k, comp) for h in b.held)
            if comp == "none":
                flat.mul_(self.weights[self.island])
                buffers.append([flat])
                works.append([dist.all_reduce(flat, group=b.group, async_op=True)])
                continue
            if comp == "bf16":
                payloads = [flat.to(torch.bfloat16).view(torch.uint8)]  # gloo: bytes
            else:
                parts = [quantize_int8(d) for d in deltas]
                payloads = [torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts])]
            got, handles = [], []
            for payload in payloads:
                out = [torch.empty_like(payload) for _ in b.ranks]
                handles.append(dist.all_gather(out, payload, group=b.group, async_op=True))
                got.extend(out)
            buffers.append(got)
            works.append(handles)
        return _InFlight(fragment, buffers, works)

    def _average(self, b: _Bucket, bufs: list[torch.Tensor]) -> torch.Tensor:
        """The tokens-weighted Delta of bucket `b`'s ranges, flat fp32."""
        assert self.settings is not None
        if b.group is None or self.settings.compression == "none":
            return bufs[0]
        order = group_order(b.ranks, self.launch_of)  # gathered chunks, by group rank
        n = len(order)
        total: torch.Tensor | None = None
        for island, rep in enumerate(b.ranks):  # b.ranks: one representative per island
            j = order.index(rep)
            if self.settings.compression == "bf16":
                value = bufs[j].view(torch.bfloat16).float()
            else:
                qs, scales = bufs[j], bufs[n + j]
                pieces, qo, so = [], 0, 0
                for h in b.held:
                    m = h.range.numel
                    nb = math.ceil(m / INT8_BLOCK)
                    pieces.append(dequantize_int8(qs[qo : qo + m], scales[so : so + nb]))
                    qo, so = qo + m, so + nb
                value = torch.cat(pieces)
            term = self.weights[island] * value
            total = term if total is None else total + term
        assert total is not None
        return total

    def _apply(self, b: _Bucket, delta: torch.Tensor) -> None:
        """planner.islands.outer_update on every element of the bucket's ranges."""
        assert self.settings is not None
        s, offset = self.settings, 0
        for h in b.held:
            d = delta[offset : offset + h.range.numel].view_as(self.outer[h.index])
            offset += h.range.numel
            buf = self.momentum[h.index]
            buf.mul_(s.momentum).add_(d)
            step = d + s.momentum * buf if s.optimizer == "nesterov" else buf
            self.outer[h.index].sub_(s.lr * step)

    @torch.no_grad()
    def _hand_off(self, fragment: int) -> None:
        """The new theta_outer from each range's representative to its island's holders, and
        into every holder's model and main parameters."""
        for b in self.hand[fragment]:
            src = b.held[0].range.representatives[self.island]
            if b.group is None:
                values = [self.outer[h.index] for h in b.held]
            else:
                if src == self.rank:
                    flat = torch.cat([self.outer[h.index].reshape(-1) for h in b.held])
                else:
                    numel = sum(h.range.numel for h in b.held)
                    flat = torch.empty(numel, dtype=torch.float32, device=b.held[0].main.device)
                dist.broadcast(flat, src=self.launch_of[src], group=b.group)
                values, offset = [], 0
                for h in b.held:
                    shape = h.view(h.main).shape
                    values.append(flat[offset : offset + h.range.numel].view(shape))
                    offset += h.range.numel
            for h, v in zip(b.held, values):
                h.view(h.main).copy_(v)
                if h.param is not h.main:
                    h.view(h.param.data).copy_(v)
