"""Committing a save: durable writes (fsync), the atomic rename of a complete temporary folder,
the pointer file, and the cross-rank status exchange that separates a save's or a load's phases.

A save killed at any point leaves the previous checkpoint and its pointer untouched: rank 0
renames `.iter_0000012.tmp` to `iter_0000012` only once every rank has written and fsynced its
file, and only then replaces the pointer (temporary name, fsync, rename).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch.distributed as dist

from megatron_hexi.checkpoint.format import iteration_dir_name
from megatron_hexi.checkpoint_files import TRACKER, CheckpointError, is_own, pointed


def fsync_file(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str | os.PathLike[str]) -> None:
    try:
        fsync_file(path)
    except OSError:  # some file systems do not support fsync on directories
        pass


def write_pointer(save_dir: str, iteration: int | None) -> None:
    """Replace latest_checkpointed_iteration.txt atomically (temporary name, fsync, rename)."""
    tmp = os.path.join(save_dir, f".{TRACKER}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write("release" if iteration is None else str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(save_dir, TRACKER))
    _fsync_dir(save_dir)


def commit_directory(save_dir: str, tmp_dir: str, iteration: int | None) -> str:
    """Rename a complete temporary directory to its final name (replacing an older save of the
    same iteration), then fsync the parent."""
    final = os.path.join(save_dir, iteration_dir_name(iteration))
    _fsync_dir(tmp_dir)
    old = None
    if os.path.lexists(final):
        if not is_own(final):
            raise CheckpointError(f"{final}: not written by this project's saves; not replaced")
        old = f"{tmp_dir}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp_dir, final)
    _fsync_dir(save_dir)
    if old:
        shutil.rmtree(old, ignore_errors=True)
    return final


def write_json(path: str, data: Any) -> None:
    """Write `data` as JSON to `path` and fsync it."""
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def agree(error: str | dict[str, list[int]] | None, what: str, value: Any = None) -> list[Any]:
    """Collective status exchange (also the barrier between save/load phases): every rank raises
    the same CheckpointError if any rank failed (`error`: a line, or {line: [launch ranks]} for
    failures gathered from other ranks), one line per distinct failure. Returns every rank's
    `value` (rank 0's is how the save id reaches the others without another collective)."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (error, value))
    failed: dict[str, list[int]] = {}
    for r, (e, _) in enumerate(everyone):
        if isinstance(e, dict):  # {error: [launch ranks]}: gathered from them by this rank
            for text, ranks in e.items():
                failed.setdefault(text, []).extend(ranks)
        elif e:
            failed.setdefault(e, []).append(r)
    if failed:
        raise CheckpointError(
            [
                f"{what}: {e} (launch rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))})"
                for e, rs in failed.items()
            ]
        )
    return [v for _, v in everyone]


class Failed(Exception):
    """Another rank's save failed (the error is already gathered): rank 0 commits nothing."""


def last_complete(save_dir: str) -> str:
    """What the pointer of `save_dir` names, for a failed save's message."""
    try:
        has, step = pointed(save_dir)
    except CheckpointError:
        has = False
    if not has:
        return f"{save_dir} holds no complete checkpoint"
    return "the last complete checkpoint is " + ("release" if step is None else f"iteration {step}")


def behind_foreign_pointer(save_dir: str, iteration: int) -> str | None:
    """Why a save of `iteration` must not move the pointer of `save_dir` back, or None: the
    pointer names a later iteration (or cannot be read) and its folder is not this project's."""
    try:
        has, step = pointed(save_dir)
    except CheckpointError as e:
        return f"{e}; not moved"
    if has and step is not None and step > iteration:
        if not is_own(os.path.join(save_dir, iteration_dir_name(step))):
            return (
                f"{os.path.join(save_dir, TRACKER)} names iteration {step}, whose folder is not "
                f"this project's checkpoint: not moved back to {iteration}"
            )
    return None
