"""Reassemble full canonical parameters from every rank's shards (tests, export, inspection).

Uses the same layout map as the gradient sync: each local tensor is split back into its pieces
and written at their global offsets. Small models only: everything goes through one process.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from megatron_hexi.process_groups import HeteroGroups
    from planner.layout import ParamShard
    from planner.plan import Plan


def assemble(
    shard_lists: Iterable[Iterable[tuple[ParamShard, torch.Tensor]]],
) -> dict[str, torch.Tensor]:
    """{canonical name: full tensor} from [(ParamShard, local tensor)] lists of all ranks."""
    full: dict[str, torch.Tensor] = {}
    for shards in shard_lists:
        for shard, local in shards:
            out = full.setdefault(shard.name, torch.full(shard.shape, float("nan")))
            for piece in shard.pieces:
                src = local.narrow(shard.dim, piece.local_start, piece.length)
                out.narrow(shard.dim, piece.global_start, piece.length).copy_(src)
    missing = [n for n, t in full.items() if torch.isnan(t).any()]
    if missing:
        raise RuntimeError(f"no rank holds parts of {missing}")
    return full


def gather_full_parameters(
    plan: Plan,
    rank: int,
    params: Sequence[tuple[ParamShard, torch.Tensor]],
    groups: HeteroGroups,
    dst: int = 0,
) -> dict[str, torch.Tensor] | None:
    """On launch rank `dst`: {name: full fp32 tensor}; elsewhere None."""
    mine = [(shard, p.detach().float().cpu().clone()) for shard, p in params]
    everyone: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(mine, everyone, dst=dst)
    return assemble(everyone) if everyone is not None else None
