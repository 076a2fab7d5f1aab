"""Writing checkpoints: a rank file (`write_rank_file`), a collective save of a trainer's state
(`save`), and a one-process save of whole tensors (`save_params_only`, the importer's).

Rank 0 makes `DIR/.iter_0000012.tmp`, every rank writes and fsyncs its file there, rank 0 writes
checkpoint.json and commits (megatron_hexi.checkpoint.commit). Phases are separated by a
collective status exchange (`agree`, under the --distributed-timeout-minutes timeout) so that a
failure on one rank fails the save on every rank; a save that fails removes its temporary
directory, and the next save removes what a killed one left. A save refuses NaN or inf in any
tensor it would write, as loading would refuse them: the error names the tensor and the last
complete checkpoint, which stays the one to resume.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shutil
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megatron_hexi.checkpoint.commit import (
    Failed,
    agree,
    behind_foreign_pointer,
    commit_directory,
    fsync_file,
    last_complete,
    write_json,
    write_pointer,
)
from megatron_hexi.checkpoint.format import (
    FORMAT_VERSION,
    Entry,
    entry_key,
    iteration_dir_name,
    rank_file_name,
)
from megatron_hexi.checkpoint.integrity import (
    BLOCK_BYTES,
    block_checksums,
    first_non_finite,
    meta_checksum,
)
from megatron_hexi.checkpoint.state import (
    TrainState,
    adam_steps,
    holds_sgd_momentum,
    owned_ranges,
    rng_state,
    scaler_state,
)
from megatron_hexi.checkpoint_files import (
    FORMAT,
    METADATA,
    TEMPORARY_DIR,
    CheckpointError,
    is_own,
    mark_own,
)
from planner.island_match import island_sites
from planner.layout import canonical_shards

if TYPE_CHECKING:
    from planner.models import ModelSpec


def write_rank_file(
    path: str | os.PathLike[str],
    entries: Iterable[Entry],
    iteration: int,
    save_id: str,
    block_bytes: int = BLOCK_BYTES,
) -> list[dict[str, Any]]:
    """Writes and fsyncs `path` holding `entries`,
    with each tensor's block checksums (of the bytes handed to the writer), the block size, the
    iteration and the save id in its metadata. Returns the index rows for checkpoint.json."""
    from safetensors.torch import save_file

    tensors, index = {}, []
    for kind, name, dim, start, shape, tensor in entries:
        key = entry_key(kind, name, start)
        tensors[key] = tensor.detach().cpu().contiguous()
        index.append(
            {
                "key": key,
                "kind": kind,
                "name": name,
                "dim": dim,
                "start": start,
                "length": tensor.shape[dim],
                "shape": list(shape),
                "dtype": str(tensor.dtype).replace("torch.", ""),
                "checksums": block_checksums(tensors[key], block_bytes),
            }
        )
    save_file(
        tensors,
        str(path),
        metadata={
            "format": FORMAT,
            "format_version": str(FORMAT_VERSION),
            "iteration": str(iteration),
            "save_id": save_id,
            "block_bytes": str(block_bytes),
            "index": json.dumps(index),
        },
    )
    os.chmod(path, 0o644)  # safetensors creates 0600; others on a shared file system read it
    fsync_file(path)
    return index


def save(trainer: TrainState, save_dir: str, iteration: int) -> tuple[float, int]:
    """Save the trainer's state after `iteration` steps (collective). Returns (seconds, bytes).
    Refuses, on every rank, to save a tensor that holds NaN or inf (a run that keeps going with
    --no-check-for-nan-in-loss-and-grad): a load would refuse it, so the previous checkpoint
    stays the one to resume from."""
    start = time.perf_counter()
    plan, rank, launch_rank = trainer.plan, trainer.rank, dist.get_rank()
    tmp_dir = os.path.join(save_dir, f".{iteration_dir_name(iteration)}.tmp")
    error: str | dict[str, list[int]] | None = None
    if launch_rank == 0:
        try:
            os.makedirs(save_dir, exist_ok=True)
            error = behind_foreign_pointer(save_dir, iteration)
            for name in os.listdir(save_dir):  # left by saves that were killed
                path = os.path.join(save_dir, name)
                if not (TEMPORARY_DIR.fullmatch(name) and is_own(path)):
                    continue  # only what a save of this project wrote is put back or removed
                if name.endswith(".tmp.old"):
                    final = os.path.join(save_dir, name[1 : -len(".tmp.old")])
                    if not os.path.lexists(final):  # killed between the two renames: put back
                        os.replace(path, final)
                        continue
                shutil.rmtree(path, ignore_errors=True)
            if error is None:
                os.makedirs(tmp_dir)
                mark_own(tmp_dir)
        except OSError as e:
            error = f"cannot create {tmp_dir}: {e}"
    save_id = agree(
        error,
        f"checkpoint save of iteration {iteration}",
        secrets.token_hex(8) if launch_rank == 0 else None,
    )[0]

    index, size, non_finite_count, first_bad = [], 0, 0, None
    landed: list[int] = []
    try:
        landed = trainer.outer.finish_exchanges()  # the outer state is final before it is read
        entries = [
            Entry(kind, r.name, r.dim, r.start, r.shape, t.detach())
            for r in owned_ranges(trainer)
            for kind, t in r.tensors.items()
        ]
        non_finite_count, first_bad = first_non_finite(entries)
        if entries and not non_finite_count:
            path = os.path.join(tmp_dir, rank_file_name(rank))
            index = write_rank_file(path, entries, iteration, save_id)
            size = os.path.getsize(path)
        error = None
    except Exception as e:  # noqa: BLE001 - reported on every rank by _agree
        error = f"{type(e).__name__}: {e}"
    mine = {
        "outer_landed": landed if not error else [],
        "plan_rank": rank,
        "index": index,
        "bytes": size,
        "rng": rng_state(),
        "adam_steps": sorted(adam_steps(trainer.optimizer)),
        "sgd_momentum": holds_sgd_momentum(trainer.optimizer),
        "grad_scaler": scaler_state(trainer.optimizer),
        "error": error,
        "non_finite": (non_finite_count, first_bad),
    }
    everyone: list[Any] | None = [None] * dist.get_world_size() if launch_rank == 0 else None
    dist.gather_object(mine, everyone, dst=0)
    error = None
    total = 0
    if everyone is not None:  # launch rank 0, which gathered every rank's
        try:
            failed: dict[str, list[int]] = {}
            for i, r in enumerate(everyone):
                if r["error"]:
                    failed.setdefault(r["error"], []).append(i)
            bad = [(i, r["non_finite"]) for i, r in enumerate(everyone) if r["non_finite"][0]]
            if bad:  # one line: the first tensor, the count, the ranks
                count = sum(n for _, (n, _) in bad)
                more = f", as are {count - 1} more tensors" if count > 1 else ""
                failed[
                    f"{bad[0][1][1]} is not finite{more}: not saved; {last_complete(save_dir)}"
                ] = [i for i, _ in bad]
            if failed:
                error = failed
                raise Failed
            steps = {x for r in everyone for x in r["adam_steps"]}
            if len(steps) > 1:
                raise RuntimeError(f"parameters have different Adam step counts: {sorted(steps)}")
            scalers = {json.dumps(r["grad_scaler"], sort_keys=True) for r in everyone}
            if len(scalers) > 1:
                raise RuntimeError(f"ranks hold different loss scaler states: {sorted(scalers)}")
            meta = {
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
                "iteration": iteration,
                "save_id": save_id,
                "block_bytes": BLOCK_BYTES,
                "consumed_samples": iteration * plan.global_batch_size,
                "global_batch_size": plan.global_batch_size,
                "model": dataclasses.asdict(plan.model),
                "plan": plan.to_dict(),
                "has_optimizer_state": bool(steps),
                "adam_step": steps.pop() if steps else None,
                "scheduler": trainer.scheduler.state_dict(),
                "grad_scaler": everyone[0]["grad_scaler"],
                "islands": len(plan.island_pipelines()),
                "island_sites": island_sites(plan),
                "sgd_momentum_state": all(r["sgd_momentum"] for r in everyone),
                "outer_landed": everyone[0]["outer_landed"],
                "rng": {str(r["plan_rank"]): r["rng"] for r in everyone},
                "files": {
                    rank_file_name(r["plan_rank"]): r["index"] for r in everyone if r["index"]
                },
                "saved_at": time.strftime("%Y-%m-%d %H:%M:%S"),
            }
            meta["checksum"] = meta_checksum(meta)
            total = sum(r["bytes"] for r in everyone)
            write_json(os.path.join(tmp_dir, METADATA), meta)
            commit_directory(save_dir, tmp_dir, iteration)
            write_pointer(save_dir, iteration)
        except Exception as e:  # noqa: BLE001
            if not isinstance(e, Failed):
                error = f"{type(e).__name__}: {e}"
            # Nothing of a failed save stays behind (gone already if it failed after the rename).
            shutil.rmtree(tmp_dir, ignore_errors=True)
    agree(error, f"checkpoint save of iteration {iteration}")
    return time.perf_counter() - start, total


def save_params_only(
    out_dir: str,
    model: ModelSpec,
    tensors: Mapping[str, torch.Tensor],
    extra: Mapping[str, Any] | None = None,
    iteration: int | None = None,
) -> str:
    """Write a checkpoint holding whole canonical tensors {name: tensor} as if one rank held
    everything, without optimizer state (used by the Hugging Face importer). One process."""
    names = [s.name for s in canonical_shards(model)]
    if set(names) != set(tensors):
        raise CheckpointError(
            f"params-only checkpoint: tensors {sorted(set(names) ^ set(tensors))}"
            f" do not match the model's parameters"
        )
    shapes = {s.name: (s.shape, s.dim) for s in canonical_shards(model)}
    entries = []
    for name in names:
        shape, dim = shapes[name]
        if tuple(tensors[name].shape) != tuple(shape):
            raise CheckpointError(
                f"{name}: shape {tuple(tensors[name].shape)}, the model needs {tuple(shape)}"
            )
        entries.append(Entry("param", name, dim, 0, shape, tensors[name]))
    count, first = first_non_finite(entries)
    if count:
        raise CheckpointError(
            f"{out_dir}: {first} is not finite"
            + (f", as are {count - 1} more tensors" if count > 1 else "")
            + ": not saved (a load would refuse it)"
        )
    os.makedirs(out_dir, exist_ok=True)
    tmp_dir = os.path.join(out_dir, f".{iteration_dir_name(iteration)}.tmp")
    if is_own(tmp_dir):  # left by a killed run of this project; anything else stays
        shutil.rmtree(tmp_dir, ignore_errors=True)
    os.makedirs(tmp_dir)
    mark_own(tmp_dir)
    save_id = secrets.token_hex(8)
    index = write_rank_file(
        os.path.join(tmp_dir, rank_file_name(0)), entries, iteration or 0, save_id
    )
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "iteration": iteration or 0,
        "save_id": save_id,
        "block_bytes": BLOCK_BYTES,
        "consumed_samples": 0,
        "global_batch_size": None,
        "model": dataclasses.asdict(model),
        "plan": None,
        "has_optimizer_state": False,
        "adam_step": None,
        "scheduler": None,
        "rng": {},
        "files": {rank_file_name(0): index},
        "saved_at": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    meta.update(extra or {})
    meta["checksum"] = meta_checksum(meta)
    write_json(os.path.join(tmp_dir, METADATA), meta)
    final = commit_directory(out_dir, tmp_dir, iteration)
    write_pointer(out_dir, iteration)
    return final


# ------------------------------------------------------------------------------------- reading
