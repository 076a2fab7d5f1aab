"""Forward-only pass of a global batch under the plan, returning full logits (tests, checks).

Each pipeline runs its own samples of the batch (the plan's cut) through megatron-core's 1F1B
schedule with forward_only=True; the last stages' vocabulary shards are gathered on launch
rank 0 and written at their offsets into one [batch, sequence, vocabulary] fp32 tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from megatron_hexi.training import Trainer


@torch.no_grad()
def forward_logits(trainer: Trainer, tokens: torch.Tensor) -> torch.Tensor | None:
    """tokens: [global batch, seq_length] int64, the same on every rank. Collective.

    Returns the full fp32 logits on launch rank 0, None elsewhere."""
    from megatron.core.pipeline_parallel.schedules import (
        forward_backward_pipelining_without_interleaving,
    )

    plan, v, device = trainer.plan, trainer.view, trainer.device
    G, s = plan.global_batch_size, plan.model.seq_length
    if tuple(tokens.shape) != (G, s):
        raise ValueError(
            f"forward_logits: tokens {tuple(tokens.shape)}, the plan runs "
            f"({G}, {s}) (global batch, sequence)"
        )
    first, mbs = v.samples[0], v.micro_batch_size

    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for m in range(v.num_microbatches):
            t = tokens[first + m * mbs : first + (m + 1) * mbs]
            yield t, torch.arange(s).unsqueeze(0).expand_as(t)

    def keep(output: torch.Tensor, non_loss_data: bool = True) -> torch.Tensor:
        return output.detach().float().cpu()

    def forward_step(
        data_iterator: Iterator[tuple[torch.Tensor, torch.Tensor]], model: torch.nn.Module
    ) -> tuple[torch.Tensor, Callable[..., torch.Tensor]]:
        tok = pos = None
        if v.holds_embedding:
            tok, pos = (x.to(device) for x in next(data_iterator))
        return model(tok, pos, None), keep

    pg = trainer.pg_collection()
    trainer.model.eval()
    try:
        store = forward_backward_pipelining_without_interleaving(
            forward_step_func=forward_step,
            data_iterator=batches(),
            model=[trainer.model],
            num_microbatches=v.num_microbatches,
            seq_length=s,
            micro_batch_size=mbs,
            p2p_communicator=trainer.communicator,
            pg_collection=pg,
            forward_only=True,
            collect_non_loss_data=True,
        )
    finally:
        trainer.model.train()
    mine = (
        (first, v.vocab[1], torch.cat(list(store), dim=0))
        if v.holds_output and v.vocab is not None  # an output stage holds vocabulary rows
        else None
    )
    everyone = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, everyone, dst=0)
    if everyone is None:
        return None
    full = torch.full((G, s, plan.model.vocab_size), float("nan"))
    for entry in everyone:
        if entry is not None:
            start, vocab_start, logits = entry
            full[
                start : start + logits.shape[0], :, vocab_start : vocab_start + logits.shape[2]
            ] = logits
    if torch.isnan(full).any():
        raise RuntimeError("forward_logits: some logits were produced by no rank")
    return full
