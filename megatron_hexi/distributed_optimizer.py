"""Heterogeneous ZeRO-1: fp32 master weights and Adam state sharded over each segment's ranks.

megatron-core's distributed optimizer shards one flat buffer over one data-parallel group, which
replicas of different shapes do not have. Here the unit is the gradient segment
(planner.layout): a range of one parameter held by a fixed set of ranks, at most one per pipeline
(plus the TP replicas of norms). Each segment is cut along its split dimension into one part per
holder, evenly or in proportion to the holders' GPU memory (the plan's
`training.optimizer_shard`): planner.layout's `optimizer_weight` and `weighted_split`, the same
rule the planner's memory estimate uses (`optimizer_elements`). Per step, for every rank set:

1. gradients are reduce-scattered: each holder receives the sum of its part (reduce_scatter,
   on NCCL and on gloo alike: torch's gloo backend has it);
2. each holder steps Adam on its parts' fp32 master weights;
3. the updated parts are all-gathered back into every holder's parameters.

The optimizer is the collective of the gradient sync's buckets (grad_sync.BucketCollective), so
with the plan's `overlap_grad_reduce` each bucket's reduce-scatter starts during the last
backward. With `overlap_param_gather` the all-gathers start after the step and each module's
next forward waits for the buckets that hold its parameters. Buckets cut at `--ddp-bucket-size`
cut a segment into pieces, each split among its holders by the same rule (the ownership then
differs from the planner's estimate by rounding only).

Under loss scaling (fp16) each rank unscales its parts' gradients and checks them for inf/NaN with
megatron-core's own code (MixedPrecisionOptimizer), whose flag is all-reduced over the world: a
part's owner is the only rank that sees its gradient after the reduce-scatter, so every rank must
hear of it to skip the same step.

Every gradient element is owned by exactly one rank, so the norm for clipping is exact. Parts
are ranges of the canonical tensor (`MasterPart.name/dim/global_start/length`), which is what
checkpoints store.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist
from megatron.core.optimizer.optimizer import MegatronOptimizer, MixedPrecisionOptimizer

from megatron_hexi.adam import inner_optimizer
from megatron_hexi.grad_sync import Pending, clip_by_norm_, global_norm
from megatron_hexi.process_groups import group_order
from planner.layout import optimizer_weight
from planner.splits import weighted_split

if TYPE_CHECKING:
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.grad_scaler import MegatronGradScaler

    from megatron_hexi.grad_sync import GradientSync, Slot
    from planner.plan import Plan


@dataclass
class MasterPart:
    """One part of one segment that this rank owns: its canonical range and fp32 master copy."""

    param: torch.Tensor
    name: str  # canonical parameter name
    dim: int
    global_start: int  # in the canonical tensor, along dim
    local_start: int  # in this rank's parameter, along dim
    length: int
    master: torch.Tensor  # fp32 copy of the part

    def param_view(self) -> torch.Tensor:
        return self.param.narrow(self.dim, self.local_start, self.length)


class _Gather(NamedTuple):
    """A bucket's all-gather in flight: one chunk per member (group rank order)."""

    chunks: list[torch.Tensor]
    work: dist.Work


@dataclass
class _Region:
    """One member's parts of every segment of a rank set, in buffer order."""

    pieces: list[tuple[int, int, int, int]]  # (slot index, part start, part length, numel)
    numel: int
    position: int  # the member's rank in the group: where its chunk sits in buffers


@dataclass
class _RankSet:
    """One gradient bucket as the optimizer shards it: every member's region of the buffer."""

    ranks: tuple[int, ...]  # plan ranks, sorted: the order of the split and the weights
    group: dist.ProcessGroup | None  # None for this rank alone
    slots: list[Slot]  # this rank's slices in buffer order
    regions: list[_Region]  # per member, in `ranks` order
    me: int  # this rank's index in `ranks`
    mine: list[MasterPart]  # per piece of regions[me] (zero-length ones too)

    @property
    def width(self) -> int:
        """Elements of one member's chunk of the bucket's buffers (the largest region)."""
        return max(r.numel for r in self.regions)


class HeteroDistributedOptimizer(MegatronOptimizer):
    """Adam(W) over this rank's master parts, with reduce-scatter / all-gather per rank set."""

    def __init__(
        self,
        plan: Plan,
        grad_sync: GradientSync,
        config: OptimizerConfig,
        shard_mode: str,
        device: torch.device,
        model: torch.nn.Module | None = None,
        grad_scaler: MegatronGradScaler | None = None,
    ):
        """`model`: this rank's stage, hooked to wait for the parameter all-gathers when the
        plan's `training.overlap_param_gather` is on. `grad_scaler`: loss scaling (fp16;
        optimizer.build_grad_scaler), None for none."""
        self.plan, self.grad_sync, self.rank = plan, grad_sync, grad_sync.plan_rank
        self.device = device
        self.overlap_param_gather = plan.training.overlap_param_gather
        self._gathers: dict[int, _Gather] = {}  # bucket index -> all-gather in flight
        self.parts: list[MasterPart] = []  # this rank's
        self.sets: list[_RankSet] = []  # one per gradient bucket
        for bucket in grad_sync.buckets:
            ranks, group, slots = bucket.ranks, bucket.group, bucket.slots
            weights = [optimizer_weight(plan.ranks[r].gpu, shard_mode) for r in ranks]
            # Which part a member owns follows the plan (the same under every launch), but
            # reduce_scatter and all_gather order their chunks by group rank, which follows
            # launch rank: each member's chunk goes where its group rank says.
            order = group_order(ranks, grad_sync.launch_of)
            regions = [_Region([], 0, order.index(r)) for r in ranks]
            for k, slot in enumerate(slots):
                starts = 0
                inner = slot.param.numel() // slot.param.shape[slot.dim]
                for i, n in enumerate(weighted_split(slot.length, weights)):
                    regions[i].pieces.append((k, starts, n, n * inner))
                    regions[i].numel += n * inner
                    starts += n
            me = ranks.index(self.rank)
            mine: list[MasterPart] = []  # aligned with regions[me].pieces
            for k, start, n, _ in regions[me].pieces:
                slot = slots[k]
                view = slot.param.detach().narrow(slot.dim, slot.start + start, n)
                master = view.float().clone(memory_format=torch.contiguous_format)
                mine.append(
                    MasterPart(
                        slot.param,
                        slot.name,
                        slot.dim,
                        slot.global_start + start,
                        slot.start + start,
                        n,
                        master,
                    )
                )
            self.parts += [p for p in mine if p.length]
            self.sets.append(_RankSet(ranks, group, slots, regions, me, mine))
        decay = [p.master for p in self.parts if p.param.ndim > 1]
        no_decay = [p.master for p in self.parts if p.param.ndim == 1]
        groups = [
            {
                "params": decay,
                "wd_mult": 1.0,
                "lr_mult": 1.0,
                "default_config": True,
                "is_expert_parallel": False,
            },
            {
                "params": no_decay,
                "wd_mult": 0.0,
                "lr_mult": 1.0,
                "default_config": True,
                "is_expert_parallel": False,
            },
        ]
        torch_opt = inner_optimizer([g for g in groups if g["params"]] or [{"params": []}], config)
        super().__init__(torch_opt, config, lambda o: None)
        self.grad_scaler = grad_scaler
        # megatron-core's found-inf flag (MixedPrecisionOptimizer), on the scale's device
        self.found_inf = torch.zeros(1, dtype=torch.float, device=device)
        self.is_stub_optimizer = False
        self._found_grads = False
        grad_sync.collective = self
        if self.overlap_param_gather:
            if model is None:
                raise ValueError("overlap_param_gather needs the model to hook its forward")
            self._hook_param_gather(model)

    # -- gradients: grad_sync's BucketCollective for the buckets it starts -----------------
    @torch.no_grad()
    def start_bucket(self, index: int) -> Pending:
        """Lay the bucket's gradients out member by member and start the reduce-scatter."""
        rs = self.sets[index]
        ranks, group, slots, regions = rs.ranks, rs.group, rs.slots, rs.regions
        if group is None:  # this rank alone: finish_bucket reads the gradients in place
            return Pending(None, None)
        width = rs.width
        buf = self.grad_sync.buffers.get(index, width * len(ranks), slots[0].param.device)
        buf.zero_()
        for region in regions:
            offset = region.position * width
            for k, start, n, numel in region.pieces:
                slot = slots[k]
                if slot.contributes and n:
                    # fp32 `main_grad` under bf16 (grad_sync.FP32MainGrads), else `.grad`
                    g = slot.grad().narrow(slot.dim, slot.start + start, n)
                    buf[offset : offset + numel].copy_(g.reshape(-1))
                offset += numel
        mine = torch.empty(width, dtype=buf.dtype, device=buf.device)
        return Pending(mine, dist.reduce_scatter_tensor(mine, buf, group=group, async_op=True))

    @torch.no_grad()
    def finish_bucket(self, index: int, pending: Pending, num_tokens: torch.Tensor | float) -> None:
        """Wait, divide by the token count, and make this rank's part its masters' gradient."""
        rs = self.sets[index]
        buf, work = pending
        self._found_grads = True
        if buf is None or work is None:  # this rank alone (both None): its masters' gradients
            # straight from the gradients
            self._own_gradients(rs, num_tokens)
            return
        work.wait()
        mine = buf / num_tokens
        offset = 0
        for part, (_, _, n, numel) in zip(rs.mine, rs.regions[rs.me].pieces):
            if n:
                part.master.grad = mine[offset : offset + numel].view_as(part.master).clone()
            offset += numel

    def _own_gradients(self, rs: _RankSet, num_tokens: torch.Tensor | float) -> None:
        """A rank set of one holder: each master's gradient is its slice of the gradient
        divided by the token count, in one foreach call (no flat buffer, no copies)."""
        parts, views = [], []
        for part, (k, start, n, _) in zip(rs.mine, rs.regions[rs.me].pieces):
            slot = rs.slots[k]
            if n:
                parts.append(part)
                if slot.contributes:
                    # fp32 `main_grad` under bf16 (grad_sync.FP32MainGrads), else `.grad`
                    views.append(slot.grad().narrow(slot.dim, slot.start + start, n))
                else:
                    views.append(torch.zeros_like(part.master))
        for part, grad in zip(parts, torch._foreach_div(views, num_tokens) if views else []):
            part.master.grad = grad.contiguous()

    # -- parameters ------------------------------------------------------------------------
    @torch.no_grad()
    def all_gather_params(self) -> None:
        """Every holder gets every part's updated values (waits for all of them)."""
        self.start_param_gather()
        self.finish_param_gather()

    @torch.no_grad()
    def start_param_gather(self) -> None:
        """Start every bucket's all-gather of updated parts, in forward order (the reverse of
        the buckets' global order, so again one order on every rank)."""
        for i in reversed(range(len(self.sets))):
            rs = self.sets[i]
            if rs.group is None:  # this rank alone: the masters go straight into the parameters
                parts = [part for part in rs.mine if part.length]
                if parts:
                    torch._foreach_copy_(
                        [
                            part.param.data.narrow(part.dim, part.local_start, part.length)
                            for part in parts
                        ],
                        [part.master for part in parts],
                    )
                continue
            width = rs.width
            mine = torch.zeros(width, dtype=rs.slots[0].param.dtype, device=self.device)
            offset = 0
            for part, (_, _, n, numel) in zip(rs.mine, rs.regions[rs.me].pieces):
                if n:
                    mine[offset : offset + numel].copy_(part.master.reshape(-1))
                offset += numel
            gathered = [torch.empty_like(mine) for _ in rs.ranks]
            work = dist.all_gather(gathered, mine, group=rs.group, async_op=True)
            self._gathers[i] = _Gather(gathered, work)

    @torch.no_grad()
    def finish_param_gather(self, indices: Iterable[int] | None = None) -> None:
        """Wait for the all-gathers of buckets `indices` (None: all started) and write them
        into the parameters. A bucket already written is skipped."""
        for i in list(self._gathers) if indices is None else indices:
            got = self._gathers.pop(i, None)
            if got is None:
                continue
            got.work.wait()
            rs = self.sets[i]
            for region in rs.regions:
                offset = 0
                chunk = got.chunks[region.position]
                for k, start, n, numel in region.pieces:
                    slot = rs.slots[k]
                    if n:
                        view = slot.param.data.narrow(slot.dim, slot.start + start, n)
                        view.copy_(chunk[offset : offset + numel].view_as(view))
                    offset += numel

    def _wait_before_forward(
        self, indices: tuple[int, ...], module: torch.nn.Module, args: Any
    ) -> None:
        """Forward pre-hook: the module's parameters must hold this step's values."""
        if self._gathers:
            self.finish_param_gather(indices)

    def _hook_param_gather(self, model: torch.nn.Module) -> None:
        """Each module that owns parameters waits, just before its forward, for the
        all-gathers of the buckets that hold them (as Megatron-LM's overlapped param gather)."""
        sets_of: dict[int, set[int]] = {}
        for i, rs in enumerate(self.sets):
            for slot in rs.slots:
                sets_of.setdefault(id(slot.param), set()).add(i)
        for module in model.modules():
            needed = sorted(
                {i for p in module.parameters(recurse=False) for i in sets_of.get(id(p), ())}
            )
            if needed:
                module.register_forward_pre_hook(partial(self._wait_before_forward, tuple(needed)))

    # -- MegatronOptimizer interface ---------------------------------------------------------
    def get_main_grads_for_grad_norm(self) -> list[torch.Tensor]:
        """The owned parts' fp32 gradients: whole tensors of their own, so contiguous."""
        return [p.master.grad for p in self.parts if p.master.grad is not None]

    def get_grad_stats_parallel_group(self) -> Any:
        return dist.group.WORLD

    def _collect_main_grad_data_for_unscaling(self) -> list[torch.Tensor]:
        """What megatron-core's unscale-and-check reads: the owned parts' master gradients."""
        return self.get_main_grads_for_grad_norm()

    def prepare_grads(self) -> bool:
        """Whether this step's gradients hold an inf or NaN on any rank (loss scaling only:
        they are unscaled first, and the scaler updated), as MixedPrecisionOptimizer's."""
        if not self._found_grads:
            raise RuntimeError("the gradient sync must run before the optimizer step")
        if self.grad_scaler is None:
            return False
        # megatron-core's unscale, check and all-reduce of the flag over
        # get_grad_stats_parallel_group() (the world); it reads only what this class defines
        found_inf = bool(MixedPrecisionOptimizer._unscale_main_grads_and_check_for_nan(self))
        self.grad_scaler.update(found_inf)
        return found_inf

    def step_with_ready_grads(self) -> bool:
        self.optimizer.step()
        if self.overlap_param_gather:
            self.start_param_gather()  # waited on by the next forward (or finish_param_gather)
        else:
            self.all_gather_params()
        return True

    @torch.no_grad()
    def step(self) -> tuple[bool, torch.Tensor | None, None]:
        """(success, the gradient norm as a device tensor or None unclipped, None); (False,
        None, None) for a step skipped on an inf or NaN under loss scaling."""
        if self.prepare_grads():
            self._found_grads = False
            return False, None, None
        grad_norm = None
        if self.config.clip_grad > 0.0:
            grad_norm = self.clip_grad_norm(self.config.clip_grad)
        success = self.step_with_ready_grads()
        self._found_grads = False
        return success, grad_norm, None

    def get_grad_norm(self) -> torch.Tensor:
        """The exact global norm: every element's master gradient lives on exactly one rank
        (a device tensor, read at the step's end)."""
        grads = self.get_main_grads_for_grad_norm()
        return global_norm(grads, self.device, self.grad_sync.norm_group)

    def clip_grad_norm(self, clip_grad: float) -> torch.Tensor:
        norm = self.get_grad_norm()
        clip_by_norm_(self.get_main_grads_for_grad_norm(), clip_grad, norm)
        return norm

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.parts:
            p.master.grad = None
        for rs in self.sets:
            for slot in rs.slots:
                slot.param.grad = None

    def get_loss_scale(self) -> torch.Tensor:
        if self.grad_scaler is not None:
            return self.grad_scaler.scale
        return torch.ones(1, device=self.device)

    def reload_model_params(self, state_dict: dict | None = None) -> None:
        self.finish_param_gather()
        for p in self.parts:
            p.master.copy_(p.param_view().float())

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def sharded_state_dict(self, *args: Any, **kwargs: Any) -> dict:
        raise RuntimeError(
            "megatron-core dist-checkpointing is not used; see megatron_hexi.checkpoint"
        )

    def state_bytes(self) -> int:
        """Bytes of fp32 master weights and Adam state this rank holds."""
        n = sum(p.master.numel() for p in self.parts)
        return n * 4 * 3
