"""Reading a Hugging Face safetensors folder for the converter: only regular files inside the
folder given, every tensor once, floating-point only, every problem one line naming the file.

A `model.safetensors.index.json` is a file written by someone else: its shard names must be plain
file names inside the folder (no `..`, no absolute path, no symbolic link that leads out), each
shard must hold exactly the tensors the index gives it, and no tensor may be in two files (which
one would win depends on the reading order). Each shard's header is read and checked (dtypes,
names) before its tensors are: an integer, boolean or fp8 tensor cannot become a weight of this
checkpoint format, which stores float32, bfloat16, float16 and float64 only.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from planner.errors import SpecError
from planner.inputs import read_json

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
# safetensors' dtype names of the tensors a checkpoint of this format can store
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit on its JSON header


class WeightFiles(NamedTuple):
    """The safetensors files of a folder, and the index's {tensor: file} (None: one file)."""

    files: list[str]
    weight_map: dict[str, str] | None


def folder_file(folder: str, name: str, what: str) -> str:
    """The regular file `name` inside `folder` (a real path): SpecError if `name` leaves the
    folder, itself or through a symbolic link, or is not a regular file."""
    parts = name.replace("\\", "/").split("/")
    if os.path.isabs(name) or ".." in parts or not name:
        raise SpecError(
            f"{what}: names {name!r}, a path outside {folder} (only files inside the folder "
            f"given are read)"
        )
    path = os.path.join(folder, name)
    real = os.path.realpath(path)
    if os.path.commonpath([real, folder]) != folder:
        raise SpecError(
            f"{path}: a symbolic link leading outside {folder} (only files inside the folder "
            f"given are read; copy the files themselves, e.g. hf download --local-dir)"
        )
    if not os.path.isfile(real):
        missing = not os.path.lexists(path)
        raise SpecError(
            f"{path}: {'no such file' if missing else 'not a regular file'}"
            + (f" (named by {what})" if what != path else "")
        )
    return real


def read_config(folder: str) -> dict[str, Any]:
    """config.json of the folder, a JSON object within the planner's JSON limits."""
    path = folder_file(folder, CONFIG, os.path.join(folder, CONFIG))
    cfg = read_json(path, "config.json")
    if not isinstance(cfg, dict):
        raise SpecError(f"{path}: expected a JSON object (a Hugging Face config)")
    return cfg


def weight_files(folder: str) -> WeightFiles:
    """model.safetensors, or the shards model.safetensors.index.json lists."""
    single, index = os.path.join(folder, SINGLE), os.path.join(folder, INDEX)
    if os.path.lexists(single):
        return WeightFiles([folder_file(folder, SINGLE, single)], None)
    if not os.path.lexists(index):
        raise SpecError(f"{folder}: no {SINGLE} or {INDEX} (only safetensors checkpoints are read)")
    path = folder_file(folder, INDEX, index)
    data = read_json(path, "safetensors index")
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise SpecError(
            f"{path}: expected a JSON object with a non-empty \"weight_map\" object "
            f"(tensor name -> shard file name)"
        )
    for name, file in weight_map.items():
        if not isinstance(file, str):
            raise SpecError(f"{path}: weight_map[{name!r}] is not a file name")
    files = {file: folder_file(folder, file, path) for file in sorted(set(weight_map.values()))}
    return WeightFiles(list(files.values()), {n: files[f] for n, f in weight_map.items()})


def read_header(path: str) -> dict[str, Mapping[str, Any]]:
    """{tensor name: {"dtype", "shape", ...}} of a safetensors file, checked to be well formed."""
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            (length,) = struct.unpack("<Q", raw) if len(raw) == 8 else (None,)
            if length is None or length > min(size - 8, MAX_HEADER_BYTES):
                raise SpecError(f"{path}: not a safetensors file (its header length is wrong)")
            header = json.loads(f.read(length))
    except OSError as e:
        raise SpecError(f"{path}: cannot read ({e.strerror})") from None
    except (ValueError, RecursionError):
        raise SpecError(f"{path}: not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise SpecError(f"{path}: not a safetensors file (its header is not a JSON object)")
    header.pop("__metadata__", None)
    for name, entry in header.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("dtype"), str):
            raise SpecError(f"{path}: not a safetensors file (entry {name!r} is malformed)")
    return header


def read_tensors(folder: str) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors file(s), each from exactly one file."""
    from safetensors.torch import load_file

    found = weight_files(folder)
    owner: dict[str, str] = {}
    for path in found.files:
        for name, entry in read_header(path).items():
            if name in owner:
                raise SpecError(
                    f"{path}: tensor {name} is also in {owner[name]} (a tensor must be in "
                    f"one file only)"
                )
            if entry["dtype"] not in FLOAT_DTYPES:
                raise SpecError(
                    f"{path}: tensor {name} has dtype {entry['dtype']}; weights must be "
                    f"floating point ({', '.join(FLOAT_DTYPES)})"
                )
            if found.weight_map is not None and found.weight_map.get(name) != path:
                where = found.weight_map.get(name)
                raise SpecError(
                    f"{os.path.join(folder, INDEX)}: tensor {name} is in {path}, but the index "
                    + (f"says {where}" if where else "does not list it")
                )
            owner[name] = path
    if found.weight_map is not None:
        missing = sorted(set(found.weight_map) - set(owner))
        if missing:
            raise SpecError(
                f"{os.path.join(folder, INDEX)}: tensor {missing[0]} is not in "
                f"{found.weight_map[missing[0]]}"
                + (f" ({len(missing) - 1} more missing)" if len(missing) > 1 else "")
            )
    tensors: dict[str, torch.Tensor] = {}
    for path in found.files:
        try:
            tensors.update(load_file(path))
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise SpecError(f"{path}: cannot read ({str(e).splitlines()[0][:200]})") from None
    return tensors
