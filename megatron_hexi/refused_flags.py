"""Megatron-LM flags pretrain_gpt.py knows and refuses, each with why and what replaces it.

They are parser arguments (so a refused flag takes its values and the rest of the command line is
still read, and --help lists them), and every one given is one line of the single error message
(megatron_hexi.arguments). A flag that is in neither the parser nor this table is refused as
unknown. docs/megatron-flags.md lists both tables (megatron_hexi.flag_docs).
"""

from __future__ import annotations

import argparse
from typing import NamedTuple


class Refused(NamedTuple):
    flag: str
    nargs: int | str  # the values Megatron-LM's flag takes: 0, 1, 3 or "+"
    why: str  # why it is refused; then what to do instead


REFUSED = (
    Refused(
        "--rampup-batch-size",
        3,
        "a plan fixes the global batch size for the whole run; plan each batch size with "
        "hexi-plan and continue under the next plan with --load",
    ),
    Refused(
        "--step-batch-size-schedule",
        1,
        "a plan fixes the global batch size for the whole run (this is Megatron-LM's newer "
        "--rampup-batch-size); plan each batch size with hexi-plan and continue under the next "
        "plan with --load",
    ),
    Refused(
        "--ckpt-format",
        1,
        "checkpoints are this runtime's own per-rank format, whatever the value; drop the flag "
        "and convert with hexi-convert import-megatron / export-megatron",
    ),
    Refused(
        "--use-checkpoint-args",
        0,
        "the plan fixes the model and the batch, not the checkpoint; give the plan the "
        "checkpoint was trained under (--hetero-plan-path, or the one --save keeps in plans/)",
    ),
    Refused(
        "--context-parallel-size",
        1,
        "context parallelism is not implemented; drop the flag (the plan's tensor and pipeline "
        "parallelism split the model)",
    ),
    Refused(
        "--virtual-pipeline-model-parallel-size",
        1,
        "the interleaved pipeline schedule is not implemented; drop the flag (the plan sets "
        "each pipeline's stages)",
    ),
    Refused(
        "--num-layers-per-virtual-pipeline-stage",
        1,
        "the interleaved pipeline schedule is not implemented; drop the flag (the plan sets "
        "each pipeline's stages)",
    ),
    Refused(
        "--decoder-first-pipeline-num-layers",
        1,
        "the plan sets each stage's layers; drop the flag (hexi-plan manual fixes a split)",
    ),
    Refused(
        "--decoder-last-pipeline-num-layers",
        1,
        "the plan sets each stage's layers; drop the flag (hexi-plan manual fixes a split)",
    ),
    Refused(
        "--expert-model-parallel-size",
        1,
        "mixture-of-experts models are not implemented; drop the flag",
    ),
    Refused("--num-experts", 1, "mixture-of-experts models are not implemented; drop the flag"),
    Refused(
        "--tp-comm-overlap",
        0,
        "Transformer Engine's tensor-parallel communication overlap is not implemented; drop "
        "the flag",
    ),
    Refused(
        "--use-legacy-models",
        0,
        "only megatron-core's models run (as --use-mcore-models); drop the flag",
    ),
    Refused(
        "--qk-layernorm",
        0,
        "the plan's models have no query/key layer norm; drop the flag (or train such a model "
        "with Megatron-LM)",
    ),
    Refused(
        "--apply-layernorm-1p",
        0,
        "the plan's models have no zero-centred layer-norm weights; drop the flag (or train "
        "such a model with Megatron-LM)",
    ),
    Refused(
        "--log-num-zeros-in-grad",
        0,
        "counting zero gradient elements is not implemented; drop the flag (the iteration line "
        "has the gradient norm, and --log-params-norm adds the parameters')",
    ),
    Refused(
        "--fp8-format",
        1,
        "fp8 training is not implemented; drop the flag and train in bf16 (--bf16)",
    ),
    Refused(
        "--dataloader-type",
        1,
        "samples are read in megatron-core's GPTDataset order (Megatron-LM's `single`); drop "
        "the flag",
    ),
    Refused(
        "--num-workers",
        1,
        "the data is read in the training process (megatron-core's dataset is in memory-mapped "
        "files); drop the flag",
    ),
)

REFUSED_DESTS = frozenset(r.flag[2:].replace("-", "_") for r in REFUSED)


def add_refused(parser: argparse.ArgumentParser) -> None:
    """The group of refused flags: each takes its values (so the rest of the line still parses)
    and is None unless given."""
    g = parser.add_argument_group(
        "refused (Megatron-LM flags this runtime does not take; each says what to use instead)"
    )
    for r in REFUSED:
        if r.nargs == 0:
            g.add_argument(r.flag, action="store_true", default=None, help=f"refused: {r.why}")
        else:
            g.add_argument(
                r.flag,
                nargs=None if r.nargs == 1 else r.nargs,
                default=None,
                metavar="X",
                help=f"refused: {r.why}",
            )


def refused_problems(args: argparse.Namespace) -> list[str]:
    """One line per refused flag that was given."""
    return [
        f"{r.flag} is refused: {r.why}"
        for r in REFUSED
        if getattr(args, r.flag[2:].replace("-", "_"), None) is not None
    ]
