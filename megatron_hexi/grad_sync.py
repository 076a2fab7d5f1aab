"""Weighted data-parallel gradient sync across pipelines of different shapes.

Losses are per-token sums, so after the backward passes every rank holds the *sum* of its
micro-batches' gradients. Each atomic segment (planner.layout.gradient_segments) is summed once
over the ranks that hold it, one per pipeline (TP replicas of norms contribute once), and divided
by the global token count: exactly the gradient of the mean loss over the global batch. Under
islands (planner.islands) the segments are an island's and the count is the island's tokens: the
gradient of the island's mean loss. Segments
with the same rank set share one buffer and one all-reduce, and the all-reduces run in one global
order on every rank, so overlapping groups cannot deadlock. With the plan's overlap_grad_reduce
each bucket's collective starts during the last backward, as soon as its gradients are final
(`GradientSync`).

Under bf16 the gradients are summed in fp32 (`FP32MainGrads`, megatron-core's `main_grad`): the
micro-batches' gradients accumulate there, the sync and the norm read and write it, and the fp32
master weights take it as their gradient. Nothing is rounded to bf16 on the way.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch
import torch.distributed as dist

from planner.layout import reduced_together
from planner.sync_model import BUCKET_ELEMENTS

if TYPE_CHECKING:
    from megatron_hexi.process_groups import HeteroGroups
    from planner.layout import ParamShard, Segment


@dataclass(frozen=True)
class Slot:
    """A segment as this rank holds it: a slice of one local parameter."""

    param: torch.Tensor
    name: str  # canonical parameter name
    dim: int
    start: int  # along dim, in the local parameter
    global_start: int  # along dim, in the canonical tensor
    length: int
    contributes: bool

    def grad(self) -> torch.Tensor:
        """The parameter's gradient as summed: its fp32 `main_grad` where it has one."""
        grad = param_grad(self.param)
        if grad is None:
            raise RuntimeError(f"{self.name}: no gradient (the sync runs after the backward pass)")
        return grad

    def grad_view(self) -> torch.Tensor:
        return self.grad().narrow(self.dim, self.start, self.length)


def param_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The tensor that holds a parameter's gradient: `main_grad` (fp32) if set, else `.grad`."""
    main = getattr(param, "main_grad", None)
    return main if main is not None else param.grad


class FP32MainGrads:
    """fp32 gradient accumulation for bf16 parameters, as megatron-core's DDP `main_grad`.

    Without it every micro-batch's gradient is added to the bf16 `.grad`, so a long pipeline
    schedule sums tens of gradients with an 8-bit mantissa. Here each backward's `.grad` is added
    to the parameter's fp32 `main_grad` as soon as autograd has accumulated it, and `.grad` is
    dropped. One flat buffer holds every `main_grad` (4 bytes per parameter, like Megatron-LM's
    grad buffer), so zeroing is one call.

    Under the gradient-accumulation fusion (megatron_hexi.fusions) a linear layer's weight-
    gradient GEMM adds into `main_grad` itself, hands autograd a dummy `.grad` and sets
    `grad_added_to_main_grad`; the hook then only drops `.grad`, as megatron-core's DDP does,
    or that gradient would count twice. The flag is cleared with the buffer."""

    def __init__(self, parameters: Iterable[torch.nn.Parameter]):
        params = [p for p in dict.fromkeys(parameters) if p.requires_grad]
        device = params[0].device if params else torch.device("cpu")
        self.buffer = torch.zeros(
            sum(p.numel() for p in params), dtype=torch.float32, device=device
        )
        offset = 0
        self.params = params
        for p in params:
            # megatron-core's convention: the fp32 gradient is an attribute of the parameter
            p.main_grad = self.buffer[offset : offset + p.numel()].view(p.shape)  # type: ignore[attr-defined]
            # its presence makes megatron-core's fused layers return a dummy `.grad`, so that
            # this hook (and the overlapped sync's) still runs for them
            p.grad_added_to_main_grad = False  # type: ignore[attr-defined]
            offset += p.numel()
            p.register_post_accumulate_grad_hook(_add_to_main_grad)

    def zero(self) -> None:
        self.buffer.zero_()
        for p in self.params:
            p.grad_added_to_main_grad = False  # type: ignore[attr-defined]


def _add_to_main_grad(param: torch.Tensor) -> None:
    """megatron-core DDP's rule: add `.grad` unless the fused GEMM has added it already."""
    if not param.grad_added_to_main_grad or getattr(param, "zero_out_wgrad", False):  # type: ignore[attr-defined]
        param.main_grad.add_(param.grad)  # type: ignore[attr-defined]
    param.grad = None


class Bucket(NamedTuple):
    """Segments summed by one collective: over `ranks` in `group` (None: this rank alone)."""

    ranks: tuple[int, ...]  # plan ranks
    group: dist.ProcessGroup | None
    slots: list[Slot]  # this rank's slices, in buffer order


class FlatBuffers:
    """fp32 buffers the buckets are reduced in, one per bucket. On CPU each is kept from step to
    step: a fresh large buffer there costs a page fault per 4 KiB page (55 ms per 100 MB on a
    test machine, more than the copies into it), a cost GPUs do not have and the planner does
    not charge. On CUDA they are fresh each step: the caching allocator reuses the memory, and
    the buffers take no memory outside the sync."""

    def __init__(self) -> None:
        self._kept: dict[int, torch.Tensor] = {}

    def get(self, index: int, numel: int, device: torch.device) -> torch.Tensor:
        """An uninitialised fp32 buffer of `numel` elements for bucket `index`."""
        if device.type != "cpu":
            return torch.empty(numel, dtype=torch.float32, device=device)
        got = self._kept.get(index)
        if got is None or got.numel() != numel:
            got = self._kept[index] = torch.empty(numel, dtype=torch.float32, device=device)
        return got


class Pending(NamedTuple):
    """A bucket's collective in flight: the buffer it reduces into and its handle (None when
    nothing was sent: a bucket of this rank alone)."""

    buffer: torch.Tensor | None
    work: dist.Work | None


class BucketCollective(Protocol):
    """How a bucket's gradients are summed over its holders: started (asynchronously), then
    finished (waited, divided by the global token count, written where the optimizer reads)."""

    def start_bucket(self, index: int) -> Pending: ...

    def finish_bucket(
        self, index: int, pending: Pending, num_tokens: torch.Tensor | float
    ) -> None: ...


class GradientSync:
    """This rank's gradient buckets, built from the plan's segments, and the sync over them.

    Serial (the default): after the last backward, one collective per rank set, one after
    another in the plan's segment order.

    Overlapped (`overlap=True`, the plan's `training.overlap_grad_reduce`): buckets hold at most
    `bucket_size` elements and are ordered by when the backward pass produces them: segments in
    reverse plan order (output layer and last layer first, embedding last), each bucket placed
    by its last segment. A hook on every parameter counts its gradient as final once the last
    micro-batch's backward has accumulated it (megatron-core's schedule brackets the other
    micro-batches with `no_sync`); a bucket is ready when all its parameters are, and ready
    buckets start their collective in bucket order only, never out of it. Every holder derives
    the same buckets from the same plan, so every rank issues its collectives as a subsequence
    of one global order: two ranks never wait on two groups in opposite orders, which is what
    would deadlock overlapping rank sets (on NCCL as on gloo). `sync` then starts what is left
    (a parameter that got no gradient), waits for every bucket in the same order, and divides
    by the global token count after the wait, so the result is the serial sum bit for bit.
    """

    def __init__(
        self,
        plan_rank: int,
        params: Sequence[tuple[ParamShard, torch.nn.Parameter]],
        segments: Sequence[Segment],
        groups: HeteroGroups,
        shard_optimizer_state: bool = False,
        overlap: bool = False,
        bucket_size: int | None = None,
    ):
        self.plan_rank = plan_rank
        self.launch_of = groups.launch_of  # plan rank -> launch rank
        self.norm_group = groups.island  # the gradient norm's ranks: the island (None: world)
        self.overlap = overlap
        by_name: dict[str, list[torch.Tensor]] = {shard.name: [] for shard, _ in params}
        for shard, p in params:
            by_name[shard.name].append(p)
        self.owned: list[Slot] = []  # Slots this rank counts in the gradient norm
        placed: list[_Placed] = []  # this rank's slots with their rank set and global position
        for position, seg in enumerate(segments):
            mine = [ls for r, ls in seg.members if r == plan_rank]
            if not mine:
                continue
            # A rank holds a canonical tensor at most once, except a tied embedding/output pair
            # on one stage, which megatron-core keeps as a single parameter.
            param = by_name[seg.name][0]
            together = reduced_together(seg, shard_optimizer_state)
            slot = Slot(
                param,
                seg.name,
                seg.dim,
                mine[0],
                seg.start,
                seg.end - seg.start,
                plan_rank in seg.contributors or not together,
            )
            key = seg.ranks if together else (plan_rank,)
            placed.append(_Placed(key, position, slot))
            if seg.owner == plan_rank:
                self.owned.append(slot)
        if overlap and bucket_size is None:
            bucket_size = BUCKET_ELEMENTS  # Megatron-LM's floor; the planner costs the same
        self.bucket_size = bucket_size  # None: one bucket per rank set
        self.buckets: list[Bucket] = (  # in global order
            _bounded_buckets(placed, bucket_size, groups)
            if bucket_size is not None
            else _rank_set_buckets(placed, groups)
        )
        self.collective: BucketCollective = self  # the distributed optimizer puts itself here
        self.buffers = FlatBuffers()
        self.bytes_per_step = 0
        self.started_in_backward = 0  # of last step's buckets, started before `sync` (overlap)
        self._bytes = 0
        self._buckets_of: dict[int, list[int]] = {}  # id(param) -> buckets holding a slice of it
        for b, bucket in enumerate(self.buckets):
            for s in bucket.slots:
                ids = self._buckets_of.setdefault(id(s.param), [])
                if b not in ids:
                    ids.append(b)
        self._params = {id(s.param): s.param for b in self.buckets for s in b.slots}
        self._reset()
        if overlap:
            for param in self._params.values():
                # after FP32MainGrads' hook (registered first), so `main_grad` is complete
                param.register_post_accumulate_grad_hook(self._gradient_final)

    # -- overlap ---------------------------------------------------------------------------
    def no_sync(self) -> _NotFinal:
        """megatron-core's `config.no_sync_func`: gradients accumulated inside are not final
        (the schedule leaves it just before the last micro-batch's backward; a forward-only
        schedule never leaves it, and the next training schedule enters it again)."""
        return _NotFinal(self)

    def _gradient_final(self, param: torch.Tensor) -> None:
        if not self._armed or id(param) in self._final:
            return
        self._final.add(id(param))
        for b in self._buckets_of[id(param)]:
            self._waiting[b] -= 1
        self._start_ready()

    def _start_ready(self) -> None:
        """Start every bucket that is ready and whose predecessors have started, in order."""
        while self._next < len(self.buckets) and self._waiting[self._next] == 0:
            self._pending.append(self.collective.start_bucket(self._next))
            self._next += 1

    def _reset(self) -> None:
        self._armed = False
        self._final: set[int] = set()
        self._waiting = [
            len({id(s.param) for s in bucket.slots}) for bucket in self.buckets
        ]  # parameters each bucket still waits for
        self._next = 0  # the first bucket not started
        self._pending: list[Pending] = []

    # -- the sync --------------------------------------------------------------------------
    @torch.no_grad()
    def sync(self, num_tokens: torch.Tensor | float) -> None:
        """Sum every segment over its holders and divide by the global token count: start the
        buckets not started yet, in order, and finish all of them in the same order."""
        if isinstance(num_tokens, torch.Tensor):
            num_tokens = num_tokens.reshape(())  # a scalar operand of the divisions
        for p in self._params.values():
            if param_grad(p) is None:
                p.grad = torch.zeros_like(p)
        if self.overlap:
            self.started_in_backward = self._next
            self._waiting = [0] * len(self.buckets)
            self._start_ready()
            for b, pending in enumerate(self._pending):
                self.collective.finish_bucket(b, pending, num_tokens)
        else:
            for b in range(len(self.buckets)):
                self.collective.finish_bucket(b, self.collective.start_bucket(b), num_tokens)
        self.bytes_per_step, self._bytes = self._bytes, 0
        self._reset()

    @torch.no_grad()
    def start_bucket(self, index: int) -> Pending:
        """All-reduce of the bucket's contributing slices, as fp32, in one flat buffer."""
        _, group, slots = self.buckets[index]
        if group is None:
            return Pending(None, None)
        numel = sum(s.grad_view().numel() for s in slots)
        flat = self.buffers.get(index, numel, slots[0].param.device)
        offset = 0
        for s in slots:
            view = s.grad_view()
            part = flat[offset : offset + view.numel()]
            if s.contributes:
                part.view(view.shape).copy_(view)
            else:
                part.zero_()
            offset += view.numel()
        self._bytes += flat.numel() * flat.element_size()
        return Pending(flat, dist.all_reduce(flat, group=group, async_op=True))

    @torch.no_grad()
    def finish_bucket(self, index: int, pending: Pending, num_tokens: torch.Tensor | float) -> None:
        """Wait, divide by the token count, and write the sums back into the gradients."""
        slots = self.buckets[index].slots
        flat, work = pending
        if flat is None or work is None:  # this rank alone (both None): scale its slices in
            # place (no copy), one call each
            contributing = [s.grad_view() for s in slots if s.contributes]
            if contributing:
                torch._foreach_div_(contributing, num_tokens)
            others = [s.grad_view() for s in slots if not s.contributes]
            if others:
                torch._foreach_zero_(others)
            return
        work.wait()
        flat.div_(num_tokens)
        views = [s.grad_view() for s in slots]
        pieces, offset = [], 0
        for view in views:
            pieces.append(flat[offset : offset + view.numel()].view_as(view))
            offset += view.numel()
        torch._foreach_copy_(views, pieces)

    def owned_grads(self) -> list[torch.Tensor]:
        """Views of the gradient slices this rank counts in the global norm (each element once).
        A slice along dim 1 (a column range of `linear_proj` or `linear_fc2`) is strided: it goes
        to `global_norm` only, never to a fused multi-tensor kernel, which would refuse it."""
        return [s.grad_view() for s in self.owned]


class _NotFinal:
    """The context of `GradientSync.no_sync`: gradients are not final inside it."""

    def __init__(self, sync: GradientSync) -> None:
        self.sync = sync

    def __enter__(self) -> None:
        self.sync._armed = False

    def __exit__(self, *exc: object) -> None:
        self.sync._armed = True


class _Placed(NamedTuple):
    """A slot of this rank, the rank set that sums it and its segment's place in the plan's
    global segment order."""

    key: tuple[int, ...]
    position: int
    slot: Slot


def _rank_set_buckets(placed: Sequence[_Placed], groups: HeteroGroups) -> list[Bucket]:
    """One bucket per rank set, in the order of each set's first segment (serial sync)."""
    index: dict[tuple[int, ...], int] = {}
    buckets: list[Bucket] = []
    for key, _, slot in placed:
        if key not in index:
            index[key] = len(buckets)
            buckets.append(Bucket(key, groups.segment_groups.get(key), []))
        buckets[index[key]].slots.append(slot)
    return buckets


def _bounded_buckets(placed: Sequence[_Placed], bound: int, groups: HeteroGroups) -> list[Bucket]:
    """Buckets of at most `bound` elements per rank set, in backward-production order.

    Slots are taken in reverse segment order; each rank set fills one bucket at a time, and a
    slot that does not fit is cut along its split dimension (whole rows; a single row larger
    than `bound` forms a bucket of its own). Buckets are ordered by the global position of their
    last slice, which every holder computes alike: that is the order they become ready in."""
    done: list[tuple[tuple[int, int], Bucket]] = []
    open_: dict[tuple[int, ...], tuple[Bucket, int, tuple[int, int]]] = {}

    def close(key: tuple[int, ...]) -> None:
        bucket, _, last = open_.pop(key)
        done.append((last, bucket))

    for key, position, slot in reversed(placed):
        row = slot.param.numel() // slot.param.shape[slot.dim]
        taken = 0
        while taken < slot.length:
            if key not in open_:
                open_[key] = (Bucket(key, groups.segment_groups.get(key), []), 0, (0, 0))
            bucket, numel, _ = open_[key]
            rows = min(slot.length - taken, max((bound - numel) // row, 0))
            if rows == 0 and numel == 0:
                rows = 1  # a row larger than the bound
            if rows == 0:
                close(key)
                continue
            piece = (
                slot
                if rows == slot.length
                else replace(
                    slot,
                    start=slot.start + taken,
                    global_start=slot.global_start + taken,
                    length=rows,
                )
            )
            bucket.slots.append(piece)
            # reverse order: a later segment (and a later row of it) is produced earlier
            open_[key] = (bucket, numel + rows * row, (-position, taken))
            taken += rows
            if numel + rows * row >= bound:
                close(key)
    for key in list(open_):
        close(key)
    done.sort(key=lambda item: (item[0], item[1].ranks))
    return [bucket for _, bucket in done]


@torch.no_grad()
def global_norm(
    tensors: Iterable[torch.Tensor],
    device: torch.device,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The gradient norm over every rank of `group` (None: the world; an island's under
    islands), as a float64 tensor [1] on `device` (read it once, at the step's end): each rank
    passes the tensors it owns (every element is owned by exactly one rank of the group).
    Per-tensor norms accumulated in fp32 by `_foreach_norm`: one call for the contiguous
    tensors (CUDA's multi-tensor kernel) and one for the strided slices (column ranges, read in
    place one by one: no copies); their squares summed in float64 in one reduction, then one
    all-reduce."""
    tensors = list(tensors)
    if tensors:
        dense = [t for t in tensors if t.is_contiguous()]
        strided = [t for t in tensors if not t.is_contiguous()]
        norms = [
            n
            for part in (dense, strided)
            if part
            for n in torch._foreach_norm(part, 2, dtype=torch.float32)
        ]
        total = torch.stack(norms).double().square().sum().reshape(1)
    else:
        total = torch.zeros(1, dtype=torch.float64, device=device)
    dist.all_reduce(total, group=group)
    return total.sqrt()


@torch.no_grad()
def clip_by_norm_(grads: Sequence[torch.Tensor], clip: float, norm: torch.Tensor) -> None:
    """megatron-core's clipping (scale by clip / (norm + 1e-6) where that is below 1) without
    reading the norm: the factor is clamped to 1 on the device and every gradient is scaled in
    one foreach call (a factor of exactly 1 leaves it unchanged)."""
    if grads:
        # a true division, as megatron-core's float one (`clip / tensor` would take the
        # reciprocal first and round twice)
        factor = (norm.new_tensor(clip) / (norm + 1.0e-6)).clamp(max=1.0).reshape(())
        torch._foreach_mul_(list(grads), factor)
