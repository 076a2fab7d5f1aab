"""The names and records of the checkpoint format: iteration folders, rank files, the tensor
kinds, index rows and the tensors a save hands to the writer (`Entry`).

A rank file holds contiguous ranges [start, start + length) of canonical tensors along one
dimension, one safetensors tensor per (kind, canonical name, global start); checkpoint.json
lists the same rows per file (megatron_hexi.checkpoint says what else it holds).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

FORMAT_VERSION = 3  # 2: checksums, save id, iteration in every rank file; 3: per block
KINDS = ("param", "exp_avg", "exp_avg_sq")  # weights and Adam's state
ADAM_MOMENTS = KINDS[1:]
SGD_MOMENTS = ("momentum_buffer",)  # --optimizer sgd: torch.optim.SGD's state, instead
# Islands (planner.islands): island k > 0 keeps its own weights and Adam state under
# "island<k>.<kind>" (island 0 under the plain kinds), and the outer step's state, the same in
# every island, is written once: theta_outer and the outer momentum.
OUTER_KINDS = ("outer_param", "outer_momentum")
_ISLAND_KIND = re.compile(r"island[1-9]\d*\.(param|exp_avg|exp_avg_sq|momentum_buffer)")
# Model fields that do not change the parameters or the function the model computes.
NOT_COMPARED = ("name", "seq_length")
RANK_FILE = re.compile(r"rank_\d{5,}\.safetensors")
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


class Entry(NamedTuple):
    """A tensor to write: `tensor` holds [start, start + its length) along `dim` of the kind
    `kind` ("param", "exp_avg", "exp_avg_sq", "momentum_buffer", ...) of canonical tensor
    `name` of shape `shape`."""

    kind: str
    name: str
    dim: int
    start: int
    shape: Sequence[int]
    tensor: torch.Tensor


def island_kind(kind: str, island: int) -> str:
    """The name island `island`'s tensors of `kind` are saved under."""
    return kind if island == 0 else f"island{island}.{kind}"


def is_kind(value: object) -> bool:
    """Whether an index row's kind is one this format writes."""
    return isinstance(value, str) and (
        value in (*KINDS, *SGD_MOMENTS, *OUTER_KINDS) or bool(_ISLAND_KIND.fullmatch(value))
    )


def iteration_dir_name(iteration: int | None) -> str:
    return "release" if iteration is None else f"iter_{iteration:07d}"


def rank_file_name(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def entry_key(kind: str, name: str, start: int) -> str:
    return f"{kind}/{name}/{start}"


def tensor_bytes(row: Mapping[str, Any]) -> int:
    """Size in bytes of the tensor an index row describes."""
    numel = row["length"]
    for i, n in enumerate(row["shape"]):
        if i != row["dim"]:
            numel *= n
    return numel * ITEMSIZE[row["dtype"]]
