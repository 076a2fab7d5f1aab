"""Weighted data-parallel gradient sync across pipelines of different shapes.

Losses are per-token sums, so after the backward passes every rank holds the *sum* of its
micro-batches' gradients. Each atomic segment (planner.layout.gradient_segments) is summed once
over the ranks that hold it, one per pipeline (TP replicas of norms contribute once), and divided
by the global token count: exactly the gradient of the mean loss over the global batch. Segments
with the same rank set share one buffer and one all-reduce, and the all-reduces run in one global
order on every rank, so overlapping groups cannot deadlock.

Under bf16 the gradients are summed in fp32 (`FP32MainGrads`, megatron-core's `main_grad`): the
micro-batches' gradients accumulate there, the sync and the norm read and write it, and the fp32
master weights take it as their gradient. Nothing is rounded to bf16 on the way.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist

from planner.layout import reduced_together

if TYPE_CHECKING:
    from megatron_hexi.process_groups import HeteroGroups
    from planner.layout import ParamShard, Segment


@dataclass(frozen=True)
class Slot:
    """A segment as this rank holds it: a slice of one local parameter."""

    param: torch.nn.Parameter
    name: str  # canonical parameter name
    dim: int
    start: int  # along dim, in the local parameter
    global_start: int  # along dim, in the canonical tensor
    length: int
    contributes: bool

    def grad(self) -> torch.Tensor:
        """The parameter's gradient as summed: its fp32 `main_grad` where it has one."""
        return param_grad(self.param)

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
    grad buffer), so zeroing is one call."""

    def __init__(self, parameters: Iterable[torch.nn.Parameter]):
        params = [p for p in dict.fromkeys(parameters) if p.requires_grad]
        device = params[0].device if params else torch.device("cpu")
        self.buffer = torch.zeros(
            sum(p.numel() for p in params), dtype=torch.float32, device=device
        )
        offset = 0
        for p in params:
            p.main_grad = self.buffer[offset : offset + p.numel()].view(p.shape)
            offset += p.numel()
            p.register_post_accumulate_grad_hook(_add_to_main_grad)

    def zero(self) -> None:
        self.buffer.zero_()


def _add_to_main_grad(param: torch.Tensor) -> None:
    param.main_grad.add_(param.grad)
    param.grad = None


class Bucket(NamedTuple):
    """Segments summed by one collective: over `ranks` in `group` (None: this rank alone)."""

    ranks: tuple[int, ...]  # plan ranks
    group: dist.ProcessGroup | None
    slots: list[Slot]  # this rank's slices, in buffer order


class GradientSync:
    """This rank's gradient buckets, built from the plan's segments, and the sync over them."""

    def __init__(
        self,
        plan_rank: int,
        params: Sequence[tuple[ParamShard, torch.nn.Parameter]],
        segments: Sequence[Segment],
        groups: HeteroGroups,
        shard_optimizer_state: bool = False,
    ):
        self.plan_rank = plan_rank
        self.launch_of = groups.launch_of  # plan rank -> launch rank
        by_name = {shard.name: [] for shard, _ in params}
        for shard, p in params:
            by_name[shard.name].append(p)
        self.buckets: list[Bucket] = []  # in global order
        self.owned: list[Slot] = []  # Slots this rank counts in the gradient norm
        index: dict[tuple[int, ...], int] = {}
        for seg in segments:
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
            if key not in index:
                index[key] = len(self.buckets)
                self.buckets.append(Bucket(key, groups.segment_groups.get(key), []))
            self.buckets[index[key]].slots.append(slot)
            if seg.owner == plan_rank:
                self.owned.append(slot)
        self.bytes_per_step = 0

    @torch.no_grad()
    def sync(self, num_tokens: float) -> None:
        """Sum every segment over its holders and divide by the global token count."""
        for p in {id(s.param): s.param for _, _, slots in self.buckets for s in slots}.values():
            if param_grad(p) is None:
                p.grad = torch.zeros_like(p)
        total = 0
        for _, group, slots in self.buckets:
            if group is None:  # this rank alone: scale its slices in place (no copy)
                for s in slots:
                    if s.contributes:
                        s.grad_view().div_(num_tokens)
                    else:
                        s.grad_view().zero_()
                continue
            flat = torch.cat(
                [
                    s.grad_view().reshape(-1).float()
                    if s.contributes
                    else torch.zeros(s.grad_view().numel(), device=s.param.device)
                    for s in slots
                ]
            )
            dist.all_reduce(flat, group=group)
            total += flat.numel() * flat.element_size()
            flat.div_(num_tokens)
            offset = 0
            for s in slots:
                view = s.grad_view()
                view.copy_(flat[offset : offset + view.numel()].view_as(view))
                offset += view.numel()
        self.bytes_per_step = total

    def owned_grads(self) -> list[torch.Tensor]:
        """Views of the gradient slices this rank counts in the global norm (each element once).
        A slice along dim 1 (a column range of `linear_proj` or `linear_fc2`) is strided: it goes
        to `global_norm` only, never to a fused multi-tensor kernel, which would refuse it."""
        return [s.grad_view() for s in self.owned]


@torch.no_grad()
def global_norm(tensors: Iterable[torch.Tensor], device: torch.device) -> float:
    """The gradient norm over every rank: each rank passes the tensors it owns (every element is
    owned by exactly one rank). Per-tensor fp32 norms, summed in float64 on `device`, then one
    all-reduce. Strided slices are read in place: no copies, no float64 copy of a tensor, and no
    multi-tensor kernel (apex's and Transformer Engine's refuse strided inputs)."""
    total = torch.zeros(1, dtype=torch.float64, device=device)
    for t in tensors:
        total += torch.linalg.vector_norm(t, dtype=torch.float32).double().square()
    dist.all_reduce(total)
    return total.sqrt().item()
