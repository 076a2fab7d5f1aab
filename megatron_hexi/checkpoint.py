"""Checkpoints: safetensors with global offsets, written atomically, loadable under any plan.

Layout of a save directory (Megatron-LM's names for the pointer and the iteration folders):

    DIR/latest_checkpointed_iteration.txt      "12" (or "release" for an imported model)
    DIR/iter_0000012/checkpoint.json           rank 0: iteration, consumed samples, plan, model,
                                               lr scheduler, Adam step, RNG states per rank, index
    DIR/iter_0000012/rank_00003.safetensors    one file per rank that writes something

Every tensor in a rank file is a contiguous range [start, start + length) along one dimension
(`dim`) of a canonical one-device tensor (planner/layout.py), of one kind: "param" (fp32 master
weights), "exp_avg" or "exp_avg_sq" (Adam's moments share the parameter layout). The model is cut
into the atomic segments of the gradient sync, and each segment is written exactly once, by the
least-loaded rank that holds it (TP replicas and pipeline replicas are not written twice).
Loading reads, for every local piece, the overlapping ranges from whichever files hold them
(safetensors `get_slice`: a rank reads only what it needs), so a checkpoint saved under plan A
loads under plan B of the same model; the optimizer state reshards the same way.

Saving is atomic: rank 0 makes `DIR/.iter_0000012.tmp`, every rank writes and fsyncs its file
there, rank 0 writes checkpoint.json, fsyncs the directory and renames it to `iter_0000012`, and
only then replaces the pointer file (temporary name, fsync, rename). A save killed at any point
leaves the previous checkpoint and its pointer untouched. Phases are separated by a collective
status exchange (a barrier under the --distributed-timeout-minutes timeout) so that a failure on
one rank fails the save on every rank; a save that fails (a disk full while writing a rank file or
checkpoint.json) removes its temporary directory, and the next save removes what a killed one
left. A save refuses NaN or inf in any tensor it would write (weights or Adam moments, each rank
checking its own before writing; the ranks agree in the status exchange), as loading would refuse
them: the error names the tensor and the last complete checkpoint, which stays the one to resume.

Integrity. Each tensor's bytes as written (row-major, in file order) are cut into blocks of
`block_bytes` (BLOCK_BYTES, 1 MiB; the last block may be shorter), and each block's CRC-32 is
computed while the rank file is written; the file's safetensors metadata holds its index rows
(with the block checksums), the block size, the iteration and the save id (a random token rank 0
draws for each save and sends to every rank in the save's first status exchange). checkpoint.json
lists the same rows per file, the block size, the iteration, the save id, and a checksum of its
own content. Blocks, not whole tensors, so that verifying costs what reading costs: a load checks
only the blocks that overlap the bytes it reads (a slice along a tensor's first dimension is one
byte range, a few blocks; one along an inner dimension touches every row, often every block),
each block once per tensor however many slices of it a rank reads; a full read (export, a load
under the saving plan) checks every block, so any changed byte is found. Damage in bytes that a
rank does not read goes unseen by that rank: nothing wrong was loaded. Loading (--load under any
plan, export, tests) refuses, with one error naming the file and the key or tensor:
  * a checkpoint.json with a missing or malformed key, an iteration that is not the one its
    directory and pointer name, or content that does not match its own checksum (edited);
  * a rank file of another save (iteration or save id differ from checkpoint.json's) or whose
    tensor list differs from checkpoint.json's;
  * a block of a tensor that does not match its checksum (naming the block and its bytes), or a
    slice read that holds NaN or inf.
`load` runs every check inside its status exchange, so all ranks report the same error. The checks
run on a few threads (VERIFY_THREADS) while the data is copied into the trainer; a failed load
leaves the trainer unusable and ends the process.

Fault injection, for tests only: HEXI_FAULT_INJECT="kill-in-save:ITERATION:PLAN_RANK:PHASE" makes
that rank SIGKILL itself during the save of ITERATION, PHASE "written" (its file written, nothing
committed) or "renamed" (rank 0 only: the directory renamed, the pointer not yet updated).

Optimizer state is reached only through `owned_ranges` (what a rank writes) and
`restore_optimizer` (what it reads), for megatron-core's FP32/Float16 optimizers and for the
distributed optimizer (megatron_hexi.distributed_optimizer) alike: the files hold canonical
ranges, so a checkpoint saved with either loads with either, under any plan.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import random
import re
import secrets
import shutil
import signal
import time
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from megatron_hexi.adam import step_state
from megatron_hexi.checkpoint_files import (
    FORMAT,
    METADATA,
    TEMPORARY_DIR,
    TRACKER,
    CheckpointError,
    is_own,
    mark_own,
    pointed,
)
from planner.layout import canonical_shards, gradient_segments, segment_numel

if TYPE_CHECKING:
    from types import TracebackType

    import numpy.typing as npt
    from megatron.core.optimizer.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from safetensors import safe_open

    from megatron_hexi.config import CheckpointConfig
    from megatron_hexi.training import Trainer
    from planner.layout import ParamShard, Segment
    from planner.models import ModelSpec
    from planner.plan import Plan

    # A tensor to write: (kind, canonical name, dim, global start, canonical shape, tensor).
    Entry = tuple[str, str, int, int, Sequence[int], torch.Tensor]
    # What this rank writes of one canonical range: (name, dim, canonical shape, global start,
    # {kind: tensor}).
    OwnedRange = tuple[str, int, tuple[int, ...], int, dict[str, torch.Tensor]]

FORMAT_VERSION = 3  # 2: checksums, save id, iteration in every rank file; 3: per block
KINDS = ("param", "exp_avg", "exp_avg_sq")
# Model fields that do not change the parameters or the function the model computes.
NOT_COMPARED = ("name", "seq_length")
RANK_FILE = re.compile(r"rank_\d{5,}\.safetensors")
# CRC-32 (zlib) of each block of a tensor's bytes. The checksums guard against accidents (a bad
# disk, a copy cut short, a file of another save, an edit): they sit next to the data, so a
# cryptographic hash would add no protection against someone who rewrites both, and CRC-32
# catches every burst of up to 32 flipped bits in a block. It is what keeps verification cheap:
# tools/bench/checkpoint_verify.py measures 4.2 GB/s on one core, against 1.7 for sha256 and 0.9
# for blake2b (docs/benchmarks.md).
CHECKSUM = "crc32"
# Bytes per checksum block. CRC-32 runs about as fast on blocks of 256 KiB and more as on whole
# tensors (16 KiB: 18% slower, the per-call overhead); larger blocks make a rank check more bytes
# than it reads at the ends of its slices, smaller ones a larger checkpoint.json (an 8-hex-digit
# entry per block: under 2 MB per 100 GB of tensors at 1 MiB).
BLOCK_BYTES = 1 << 20
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
# Most threads per process that verify a load's blocks (CRC-32 and the NaN/inf check): torchrun
# starts one process per GPU, and each should leave the node's other cores to the other ranks.
VERIFY_THREADS = 4
HEX32 = re.compile(r"[0-9a-f]{8}")


def iteration_dir_name(iteration: int | None) -> str:
    return "release" if iteration is None else f"iter_{iteration:07d}"


def rank_file_name(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


# ------------------------------------------------------------------------------------- writing


def writer_segments(plan: Plan) -> dict[int, list[Segment]]:
    """{plan rank: [Segment]}: every atomic segment once, by the least-loaded rank holding it."""
    shapes = {s.name: s.shape for s in canonical_shards(plan.model)}
    load = [0] * plan.world_size
    out = {r: [] for r in range(plan.world_size)}
    for seg in gradient_segments(plan):
        writer = min(seg.ranks, key=lambda r: (load[r], r))
        load[writer] += segment_numel(shapes[seg.name], seg)
        out[writer].append(seg)
    return out


def local_runs(
    params: Iterable[tuple[ParamShard, torch.Tensor]], segments: Iterable[Segment]
) -> list[tuple[ParamShard, torch.Tensor, int, int, int]]:
    """[(ParamShard, param, local_start, global_start, length)]: this rank's owned segments,
    merged into runs that are contiguous both locally and in the canonical tensor."""
    owned = {}
    for seg in segments:
        owned.setdefault(seg.name, []).append((seg.start, seg.end))
    runs = []
    for shard, param in params:
        intervals = owned.get(shard.name, [])
        for piece in shard.pieces:
            lo, hi = piece.global_start, piece.global_start + piece.length
            inside = sorted(iv for iv in intervals if lo <= iv[0] and iv[1] <= hi)
            intervals = [iv for iv in intervals if iv not in inside]
            merged = []
            for s, e in inside:
                if merged and merged[-1][1] == s:
                    merged[-1][1] = e
                else:
                    merged.append([s, e])
            for s, e in merged:
                runs.append((shard, param, piece.local_start + s - lo, s, e - s))
        owned[shard.name] = intervals
    left = {n: iv for n, iv in owned.items() if iv}
    if left:
        raise RuntimeError(
            f"checkpoint: segments {left} are assigned to a rank that does not "
            f"hold them (layout bug)"
        )
    return runs


def entry_key(kind: str, name: str, start: int) -> str:
    return f"{kind}/{name}/{start}"


def block_checksums(tensor: torch.Tensor, block_bytes: int = BLOCK_BYTES) -> list[str]:
    """CRC-32 (8 hex digits) of each `block_bytes` block of a contiguous CPU tensor's bytes,
    exactly as safetensors stores them (the last block may be shorter; none if it is empty)."""
    data = tensor.reshape(-1).view(torch.uint8).numpy()
    return [
        f"{zlib.crc32(data[i : i + block_bytes]):08x}" for i in range(0, data.size, block_bytes)
    ]


def tensor_bytes(row: Mapping[str, Any]) -> int:
    """Size in bytes of the tensor an index row describes."""
    numel = row["length"]
    for i, n in enumerate(row["shape"]):
        if i != row["dim"]:
            numel *= n
    return numel * ITEMSIZE[row["dtype"]]


def overlapping_blocks(
    shape: Sequence[int], itemsize: int, dim: int, a: int, b: int, block_bytes: int
) -> np.ndarray:
    """Boolean array over the blocks of a row-major tensor of `shape`: True where a block holds
    bytes of the slice [a, b) along `dim` (one byte run per index of the dimensions before it)."""
    inner = itemsize
    for n in shape[dim + 1 :]:
        inner *= n
    outer = 1
    for n in shape[:dim]:
        outer *= n
    nbytes = outer * shape[dim] * inner
    nblocks = -(-nbytes // block_bytes)
    if nbytes == 0 or b <= a:
        return np.zeros(nblocks, dtype=bool)
    first = a * inner + shape[dim] * inner * np.arange(outer, dtype=np.int64)
    last = first + (b - a) * inner - 1
    # +1 where a run starts, -1 after the block where it ends: the running sum is > 0 on blocks
    # some run overlaps (runs are sorted and disjoint).
    marks = np.bincount(first // block_bytes, minlength=nblocks + 1) - np.bincount(
        last // block_bytes + 1, minlength=nblocks + 1
    )
    return np.cumsum(marks[:nblocks]) > 0


def blocks_bytes(blocks: npt.ArrayLike, block_bytes: int, nbytes: int) -> int:
    """Bytes in the blocks `blocks` (indices) of a tensor of `nbytes` bytes cut into blocks of
    `block_bytes`, the last one shorter when `block_bytes` does not divide `nbytes` (what a
    verified read checks; the benchmark computes the same for other block sizes)."""
    blocks = np.asarray(blocks, dtype=np.int64).reshape(-1)
    total = blocks.size * block_bytes
    last = -(-nbytes // block_bytes) - 1
    if blocks.size and blocks.max() == last:
        total -= (last + 1) * block_bytes - nbytes
    return int(total)


# Rows of a bfloat16 tensor checked per numpy call (bounds the temporary of the bit test).
FINITE_CHUNK = 1 << 20


def non_finite(t: torch.Tensor) -> bool:
    """True if the CPU tensor `t` (any strides) holds NaN or inf. numpy, not torch: numpy runs a
    reduction on the calling thread alone and releases the GIL, so the verification threads do
    not each start a team of torch's intra-op threads. min and max propagate NaN and need no
    temporary: the extremes are finite iff every value is. numpy has no bfloat16: its bits are
    tested instead (exponent all ones: inf or NaN), a chunk of rows at a time."""
    if t.numel() == 0:
        return False
    if t.dtype != torch.bfloat16:
        a = t.numpy()
        return not (np.isfinite(a.min()) and np.isfinite(a.max()))
    bits = np.atleast_1d(t.view(torch.int16).numpy().view(np.uint16))
    rows = max(1, FINITE_CHUNK // max(1, bits[0].size))
    return any(
        int((bits[i : i + rows] & 0x7FFF).max()) >= 0x7F80 for i in range(0, bits.shape[0], rows)
    )


def meta_checksum(meta: Mapping[str, Any]) -> str:
    """Checksum of checkpoint.json's content (every key but 'checksum'), in a canonical form."""
    text = json.dumps(
        {k: v for k, v in meta.items() if k != "checksum"}, sort_keys=True, separators=(",", ":")
    )
    return f"{CHECKSUM}:{zlib.crc32(text.encode()):08x}"


def write_rank_file(
    path: str | os.PathLike[str],
    entries: Iterable[Entry],
    iteration: int,
    save_id: str,
    block_bytes: int = BLOCK_BYTES,
) -> list[dict[str, Any]]:
    """entries: [(kind, name, dim, start, canonical shape, tensor)]; writes and fsyncs `path`,
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
    _fsync_file(path)
    return index


def _cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _fsync_file(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str | os.PathLike[str]) -> None:
    try:
        _fsync_file(path)
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


def _write_json(path: str, data: Any) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _fault(iteration: int, rank: int, phase: str) -> None:
    spec = os.environ.get("HEXI_FAULT_INJECT", "")
    if spec.startswith("kill-in-save:"):
        _, it, r, ph = spec.split(":")
        if int(it) == iteration and int(r) == rank and ph == phase:
            print(
                f"HEXI_FAULT_INJECT: rank {rank} kills itself in the save of iteration "
                f"{iteration} ({phase})",
                flush=True,
            )
            os.kill(os.getpid(), signal.SIGKILL)


def _agree(error: str | dict[str, list[int]] | None, what: str, value: Any = None) -> list[Any]:
    """Collective status exchange (also the barrier between save/load phases): every rank raises
    the same CheckpointError if any rank failed (`error`: a line, or {line: [launch ranks]} for
    failures gathered from other ranks), one line per distinct failure. Returns every rank's
    `value` (rank 0's is how the save id reaches the others without another collective)."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (error, value))
    failed = {}
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


class _Failed(Exception):
    """Another rank's save failed (the error is already gathered): rank 0 commits nothing."""


def _first_non_finite(entries: Sequence[Entry]) -> tuple[int, str | None]:
    """(number of entries whose tensor holds NaN or inf, "KIND of NAME (tensor KEY)" of the
    first). torch.aminmax on the tensors where they live (one pass each, NaN propagates: the
    extremes are finite iff every value is), one transfer for all."""
    extremes = [
        (i, torch.stack(torch.aminmax(e[5].detach())))
        for i, e in enumerate(entries)
        if e[5].numel()
    ]
    if not extremes:
        return 0, None
    finite = torch.stack([x for _, x in extremes]).isfinite().all(dim=1).cpu().tolist()
    bad = [i for (i, _), ok in zip(extremes, finite) if not ok]
    if not bad:
        return 0, None
    kind, name, _, start, _, _ = entries[bad[0]]
    return len(bad), f"{kind} of {name} (tensor {entry_key(kind, name, start)})"


def _last_complete(save_dir: str) -> str:
    """What the pointer of `save_dir` names, for a failed save's message."""
    try:
        has, step = pointed(save_dir)
    except CheckpointError:
        has = False
    if not has:
        return f"{save_dir} holds no complete checkpoint"
    return "the last complete checkpoint is " + ("release" if step is None else f"iteration {step}")


def _behind_foreign_pointer(save_dir: str, iteration: int) -> str | None:
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


def save(trainer: Trainer, save_dir: str, iteration: int) -> tuple[float, int]:
    """Save the trainer's state after `iteration` steps (collective). Returns (seconds, bytes).
    Refuses, on every rank, to save a tensor that holds NaN or inf (a run that keeps going with
    --no-check-for-nan-in-loss-and-grad): a load would refuse it, so the previous checkpoint
    stays the one to resume from."""
    start = time.perf_counter()
    plan, rank, launch_rank = trainer.plan, trainer.rank, dist.get_rank()
    tmp_dir = os.path.join(save_dir, f".{iteration_dir_name(iteration)}.tmp")
    error = None
    if launch_rank == 0:
        try:
            os.makedirs(save_dir, exist_ok=True)
            error = _behind_foreign_pointer(save_dir, iteration)
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
    save_id = _agree(
        error,
        f"checkpoint save of iteration {iteration}",
        secrets.token_hex(8) if launch_rank == 0 else None,
    )[0]

    index, size, non_finite_count, first_non_finite = [], 0, 0, None
    try:
        entries = []
        for name, dim, shape, global_start, tensors in owned_ranges(trainer):
            for kind in KINDS:
                if kind in tensors:
                    entries.append((kind, name, dim, global_start, shape, tensors[kind].detach()))
        non_finite_count, first_non_finite = _first_non_finite(entries)
        if entries and not non_finite_count:
            path = os.path.join(tmp_dir, rank_file_name(rank))
            index = write_rank_file(path, entries, iteration, save_id)
            size = os.path.getsize(path)
        _fault(iteration, rank, "written")
        error = None
    except Exception as e:  # noqa: BLE001 - reported on every rank by _agree
        error = f"{type(e).__name__}: {e}"
    mine = {
        "plan_rank": rank,
        "index": index,
        "bytes": size,
        "rng": rng_state(),
        "adam_steps": sorted(_adam_steps(trainer.optimizer)),
        "error": error,
        "non_finite": (non_finite_count, first_non_finite),
    }
    everyone = [None] * dist.get_world_size() if launch_rank == 0 else None
    dist.gather_object(mine, everyone, dst=0)
    error = None
    total = 0
    if launch_rank == 0:
        try:
            failed = {}
            for i, e in enumerate(everyone):
                if e["error"]:
                    failed.setdefault(e["error"], []).append(i)
            bad = [(i, e["non_finite"]) for i, e in enumerate(everyone) if e["non_finite"][0]]
            if bad:  # one line: the first tensor, the count, the ranks
                count = sum(n for _, (n, _) in bad)
                more = f", as are {count - 1} more tensors" if count > 1 else ""
                failed[
                    f"{bad[0][1][1]} is not finite{more}: not saved; {_last_complete(save_dir)}"
                ] = [i for i, _ in bad]
            if failed:
                error = failed
                raise _Failed
            steps = {x for e in everyone for x in e["adam_steps"]}
            if len(steps) > 1:
                raise RuntimeError(f"parameters have different Adam step counts: {sorted(steps)}")
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
                "rng": {str(e["plan_rank"]): e["rng"] for e in everyone},
                "files": {
                    rank_file_name(e["plan_rank"]): e["index"] for e in everyone if e["index"]
                },
                "saved_at": time.strftime("%Y-%m-%d %H:%M:%S"),
            }
            meta["checksum"] = meta_checksum(meta)
            total = sum(e["bytes"] for e in everyone)
            _write_json(os.path.join(tmp_dir, METADATA), meta)
            commit_directory(save_dir, tmp_dir, iteration)
            _fault(iteration, rank, "renamed")
            write_pointer(save_dir, iteration)
        except Exception as e:  # noqa: BLE001
            if not isinstance(e, _Failed):
                error = f"{type(e).__name__}: {e}"
            # Nothing of a failed save stays behind (gone already if it failed after the rename).
            shutil.rmtree(tmp_dir, ignore_errors=True)
    _agree(error, f"checkpoint save of iteration {iteration}")
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
        entries.append(("param", name, dim, 0, shape, tensors[name]))
    count, first = _first_non_finite(entries)
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
    _write_json(os.path.join(tmp_dir, METADATA), meta)
    final = commit_directory(out_dir, tmp_dir, iteration)
    write_pointer(out_dir, iteration)
    return final


# ------------------------------------------------------------------------------------- reading


def _is_int(v: object, low: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= low


# checkpoint.json's keys that loading uses: (key, test, what it must be)
META_KEYS = (
    ("iteration", _is_int, "an integer >= 0"),
    ("save_id", lambda v: isinstance(v, str) and v != "", "a non-empty string"),
    ("checksum", lambda v: isinstance(v, str), "a string"),
    ("block_bytes", lambda v: _is_int(v, 1), "an integer >= 1"),
    ("consumed_samples", _is_int, "an integer >= 0"),
    ("global_batch_size", lambda v: v is None or _is_int(v, 1), "null or an integer >= 1"),
    ("model", lambda v: isinstance(v, dict), "an object"),
    ("plan", lambda v: v is None or isinstance(v, dict), "null or an object"),
    ("has_optimizer_state", lambda v: isinstance(v, bool), "true or false"),
    ("adam_step", lambda v: v is None or _is_int(v), "null or an integer >= 0"),
    ("scheduler", lambda v: v is None or isinstance(v, dict), "null or an object"),
    (
        "rng",
        lambda v: isinstance(v, dict) and all(isinstance(x, dict) for x in v.values()),
        "an object of per-rank objects",
    ),
    (
        "files",
        lambda v: isinstance(v, dict) and all(isinstance(x, list) for x in v.values()),
        "an object of file name -> list of index rows",
    ),
)
ROW_KEYS = (
    ("key", lambda v: isinstance(v, str), "a string"),
    ("kind", lambda v: v in KINDS, f"one of {', '.join(KINDS)}"),
    ("name", lambda v: isinstance(v, str), "a string"),
    ("dim", _is_int, "an integer >= 0"),
    ("start", _is_int, "an integer >= 0"),
    ("length", _is_int, "an integer >= 0"),
    (
        "shape",
        lambda v: isinstance(v, list) and all(_is_int(x) for x in v),
        "a list of integers >= 0",
    ),
    ("dtype", lambda v: v in ITEMSIZE, f"one of {', '.join(ITEMSIZE)}"),
    (
        "checksums",
        lambda v: isinstance(v, list) and all(isinstance(x, str) and HEX32.fullmatch(x) for x in v),
        f"a list of {CHECKSUM}s (8 hex digits each)",
    ),
)


def check_meta(meta: dict[str, Any], path: str, iteration: int) -> None:
    """Refuse a checkpoint.json with a missing or malformed key, an iteration other than the one
    its directory is named for, or content that does not match its own checksum."""

    def test(
        obj: Mapping[str, Any],
        keys: Iterable[tuple[str, Callable[[Any], bool], str]],
        where: str,
    ) -> None:
        for key, ok, what in keys:
            if key not in obj:
                raise CheckpointError(f"{path}: key {where}{key!r} missing")
            if not ok(obj[key]):
                raise CheckpointError(
                    f"{path}: {where}{key} must be {what}, got {json.dumps(obj[key])[:60]}"
                )

    test(meta, META_KEYS, "")
    for fname, rows in meta["files"].items():
        if not RANK_FILE.fullmatch(fname):
            raise CheckpointError(
                f"{path}: files: {fname[:60]!r} is not a rank file name (rank_NNNNN.safetensors)"
            )
        for i, row in enumerate(rows):
            where = f"files.{fname}[{i}]."
            if not isinstance(row, dict):
                raise CheckpointError(f"{path}: {where[:-1]} must be an object")
            test(row, ROW_KEYS, where)
            if (
                row["key"] != entry_key(row["kind"], row["name"], row["start"])
                or row["dim"] >= len(row["shape"])
                or row["start"] + row["length"] > row["shape"][row["dim"]]
            ):
                raise CheckpointError(
                    f"{path}: {where[:-1]} ({row['key'][:80]}) is inconsistent "
                    f"(key, dim, start, length and shape disagree)"
                )
            blocks = -(-tensor_bytes(row) // meta["block_bytes"])
            if len(row["checksums"]) != blocks:
                raise CheckpointError(
                    f"{path}: {where}checksums has {len(row['checksums'])} "
                    f"entries, its {tensor_bytes(row)} bytes make {blocks} "
                    f"blocks of block_bytes {meta['block_bytes']}"
                )
    if meta["has_optimizer_state"] and meta["adam_step"] is None:
        raise CheckpointError(f"{path}: adam_step must be an integer when has_optimizer_state")
    if meta["iteration"] != iteration:
        raise CheckpointError(
            f"{path}: iteration {meta['iteration']}, but its directory is the "
            f"checkpoint of iteration {iteration} (edited, or copied from "
            f"another save)"
        )
    if meta["checksum"] != meta_checksum(meta):
        raise CheckpointError(
            f"{path}: its content does not match its checksum (edited or damaged after the save)"
        )


def pointed_step(load_dir: str) -> int | None:
    """The iteration latest_checkpointed_iteration.txt names (None: `release`); CheckpointError
    when it is missing, corrupt, or not a regular file inside `load_dir`."""
    has, step = pointed(load_dir)
    if not has:
        raise CheckpointError(
            f"{os.path.join(load_dir, TRACKER)}: missing (no checkpoint was completed in "
            f"{load_dir}; a first run of a restartable job can add --hetero-load-if-exists)"
        )
    return step


class Checkpoint:
    """One checkpoint directory, opened and checked (no torch.distributed needed). With `verify`
    (off only to measure what verification costs), every block of a tensor that a read overlaps
    is checked against its checksum, every slice read for NaN/inf, and every rank file against
    checkpoint.json. `read_bytes` and `checked_bytes` count what the verified reads read and
    what they checked (tests and the benchmark compare them)."""

    def __init__(self, load_dir: str, step: int | None = None, verify: bool = True) -> None:
        self.load_dir = load_dir
        self.verify = verify
        if not os.path.isdir(load_dir):
            raise CheckpointError(f"--load {load_dir}: no such directory")
        if step is None:
            step = pointed_step(load_dir)
        self.dir = os.path.join(load_dir, iteration_dir_name(step))
        aside = os.path.join(load_dir, f".{iteration_dir_name(step)}.tmp.old")
        if not os.path.isdir(self.dir) and os.path.isfile(os.path.join(aside, METADATA)):
            self.dir = aside  # a re-save of this iteration was killed between its two renames
        meta_path = os.path.join(self.dir, METADATA)
        if not os.path.isdir(self.dir):
            raise CheckpointError(
                f"{self.dir}: missing (the pointer or --ckpt-step names "
                f"iteration {step if step is not None else 'release'})"
            )
        try:
            with open(meta_path) as f:
                self.meta = json.load(f)
        except FileNotFoundError:
            raise CheckpointError(f"{meta_path}: missing")
        except RecursionError:
            raise CheckpointError(f"{meta_path}: corrupt (nested too deeply)")
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{meta_path}: corrupt ({e})")
        if not isinstance(self.meta, dict) or self.meta.get("format") != FORMAT:
            raise CheckpointError(f"{meta_path}: not a megatron-hexi checkpoint")
        if self.meta.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(
                f"{meta_path}: format_version {self.meta.get('format_version')},"
                f" this runtime reads {FORMAT_VERSION}"
            )
        check_meta(self.meta, meta_path, 0 if step is None else step)
        self.iteration = self.meta["iteration"]
        self.index = {}
        for fname, rows in self.meta["files"].items():
            for row in rows:
                self.index.setdefault((row["kind"], row["name"]), []).append((fname, row))
        self._files = {}
        self._tensors = {}  # (file, key): [mapped tensor, its bytes, blocks checks started]
        self._pending = []  # the checks (futures), in reading order
        self._pool = None
        self.read_bytes = 0
        self.checked_bytes = 0

    @property
    def has_optimizer_state(self) -> bool:
        return bool(self.meta.get("has_optimizer_state"))

    def check_model(self, model: ModelSpec) -> None:
        """One error naming every model field that differs from the checkpoint's."""
        saved = self.meta["model"]
        mine = dataclasses.asdict(model)
        diff = [
            f"{k}: checkpoint {saved.get(k)!r}, this run {mine[k]!r}"
            for k in mine
            if k not in NOT_COMPARED and saved.get(k) != mine[k]
        ]
        if diff:
            raise CheckpointError(f"{self.dir} holds a different model ({'; '.join(diff)})")

    def _open(self, fname: str) -> safe_open:
        from safetensors import safe_open

        if fname not in self._files:
            path = os.path.join(self.dir, fname)
            if not os.path.isfile(path):
                raise CheckpointError(f"{path}: missing")
            try:
                handle = safe_open(path, framework="pt")
                header = handle.metadata() or {}
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
                raise CheckpointError(f"{path}: corrupt or truncated ({e})")
            if self.verify:
                self._check_rank_file(path, header, fname)
            self._files[fname] = handle
        return self._files[fname]

    def _check_rank_file(self, path: str, header: Mapping[str, str], fname: str) -> None:
        """A rank file must come from this very save and list the tensors checkpoint.json does."""
        if header.get("format") != FORMAT:
            raise CheckpointError(f"{path}: not a megatron-hexi rank file")
        mine = (header.get("iteration"), header.get("save_id"))
        if mine != (str(self.iteration), self.meta["save_id"]):
            raise CheckpointError(
                f"{path}: from another save (iteration {mine[0]}, save id {mine[1]}; "
                f"{METADATA} has iteration {self.iteration}, save id {self.meta['save_id']})"
            )
        try:
            index = json.loads(header.get("index", ""))
        except ValueError:
            index = None
        if index != self.meta["files"][fname]:
            raise CheckpointError(
                f"{path}: its tensor list and checksums differ from "
                f"{METADATA}'s (a file of another save, or edited)"
            )
        if header.get("block_bytes") != str(self.meta["block_bytes"]):
            raise CheckpointError(
                f"{path}: checksum blocks of {header.get('block_bytes')} bytes, "
                f"{METADATA} says {self.meta['block_bytes']}"
            )

    def _verified_slice(
        self, path: str, f: safe_open, row: Mapping[str, Any], dim: int, a: int, b: int
    ) -> torch.Tensor:
        """Slice [a, b) along `dim` of a stored tensor, as a view of its mapping (only the pages
        it touches are read). Schedules the checks of the blocks it overlaps that no earlier read
        of this tensor scheduled, and the NaN/inf check of the slice; they run in the background,
        overlapping the caller's copies, and `finish` reports them. The caller uses the data
        before then: `load` copies it into the trainer and calls `finish` at the end, so a load
        that fails leaves the trainer half overwritten and unusable, and the process ends with
        the error (every caller does). Finishing before the copies would mean holding what a rank
        reads a second time in host memory until its checks end; nothing needs the trainer after
        a failed load."""
        state = self._tensors.get((path, row["key"]))
        if state is None:
            full = f.get_tensor(row["key"])
            if str(full.dtype).replace("torch.", "") != row["dtype"]:
                raise CheckpointError(
                    f"{path}: {row['key']} is {full.dtype}, {METADATA} says {row['dtype']}"
                )
            nblocks = len(row["checksums"])
            state = [full, full.reshape(-1).view(torch.uint8).numpy(), np.zeros(nblocks, bool)]
            self._tensors[(path, row["key"])] = state
        full, flat, started = state
        block = self.meta["block_bytes"]
        needed = overlapping_blocks(list(full.shape), full.element_size(), dim, a, b, block)
        new = np.flatnonzero(needed & ~started)
        started |= needed
        idx = [slice(None)] * full.dim()
        idx[dim] = slice(a, b)
        data = full[tuple(idx)]
        self.read_bytes += data.numel() * data.element_size()
        self.checked_bytes += blocks_bytes(new, block, flat.size)
        if self._pool is None:
            # zlib.crc32 and numpy's reductions release the GIL: the checks overlap the copies
            # into the model. Neither starts threads of its own (torch's intra-op threads, set
            # process-wide, would run a team per worker: workers x threads), so the pool alone
            # bounds the threads: at most VERIFY_THREADS, fewer on fewer cores.
            self._pool = ThreadPoolExecutor(
                min(VERIFY_THREADS, _cores()), thread_name_prefix="checkpoint-verify"
            )
        self._pending.append(
            self._pool.submit(self._check_slice, path, row, flat, block, new.tolist(), data)
        )
        return data

    @staticmethod
    def _check_slice(
        path: str,
        row: Mapping[str, Any],
        flat: np.ndarray,
        block: int,
        blocks: Iterable[int],
        data: torch.Tensor,
    ) -> None:
        what = f"{path}: {row['kind']} of {row['name']} (tensor {row['key']})"
        for i in blocks:
            lo, hi = i * block, min((i + 1) * block, flat.size)
            digest = f"{zlib.crc32(flat[lo:hi]):08x}"
            if digest != row["checksums"][i]:
                raise CheckpointError(
                    f"{what} does not match its checksum (block {i}, bytes [{lo}, {hi}): stored "
                    f"{CHECKSUM}:{row['checksums'][i]}, read {CHECKSUM}:{digest}): changed or "
                    f"damaged after the save"
                )
        if non_finite(data):
            raise CheckpointError(f"{what} holds NaN or inf")

    def finish(self) -> None:
        """Wait for the checks of the tensors read so far; raise the first failure in reading
        order (the same on every run)."""
        pending, self._pending = self._pending, []
        for error in [p.exception() for p in pending]:
            if isinstance(error, CheckpointError):
                raise error
            if error is not None:
                raise CheckpointError(
                    f"{self.dir}: checking a tensor failed ({type(error).__name__}: {error})"
                )

    def read_range(
        self,
        kind: str,
        name: str,
        dim: int,
        start: int,
        length: int,
        shape: Sequence[int],
        out: torch.Tensor,
    ) -> None:
        """Fill `out` (canonical `shape` with `length` along `dim`) with [start, start + length)
        of tensor `name`/`kind`, from whichever files hold overlapping ranges."""
        rows = self.index.get((kind, name))
        if not rows:
            raise CheckpointError(f"{self.dir}: holds no {kind} of {name}")
        covered = []
        for fname, row in rows:
            if row["dim"] != dim or tuple(row["shape"]) != tuple(shape):
                raise CheckpointError(
                    f"{self.dir}/{fname}: {row['key']} has canonical shape "
                    f"{row['shape']} (dim {row['dim']}), expected "
                    f"{list(shape)} (dim {dim})"
                )
            lo = max(start, row["start"])
            hi = min(start + length, row["start"] + row["length"])
            if lo >= hi:
                continue
            f = self._open(fname)
            path = os.path.join(self.dir, fname)
            try:
                sl = f.get_slice(row["key"])
                want = list(shape)
                want[dim] = row["length"]
                if list(sl.get_shape()) != want:
                    raise CheckpointError(
                        f"{path}: {row['key']} has shape {sl.get_shape()}, the index says {want}"
                    )
                if self.verify:
                    data = self._verified_slice(
                        path, f, row, dim, lo - row["start"], hi - row["start"]
                    )
                else:
                    idx = [slice(None)] * len(shape)
                    idx[dim] = slice(lo - row["start"], hi - row["start"])
                    data = sl[tuple(idx)]
            except CheckpointError:
                raise
            except Exception as e:  # noqa: BLE001
                raise CheckpointError(f"{path}: corrupt or truncated ({type(e).__name__}: {e})")
            out.narrow(dim, lo - start, hi - lo).copy_(data.to(out.dtype))
            covered.append((lo, hi))
        pos = start
        for lo, hi in sorted(covered):
            if lo > pos:
                break
            pos = max(pos, hi)
        if pos < start + length:
            raise CheckpointError(
                f"{self.dir}: no file holds {kind} of {name} [{pos}, "
                f"{start + length}) along dim {dim}"
            )

    def read_full(
        self,
        name: str,
        shape: Sequence[int],
        dim: int,
        kind: str = "param",
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """A whole canonical tensor (export, tests), in its stored dtype unless `dtype`."""
        rows = self.index.get((kind, name))
        if not rows:
            raise CheckpointError(f"{self.dir}: holds no {kind} of {name}")
        dtype = dtype or getattr(torch, rows[0][1].get("dtype", "float32"))
        out = torch.empty(shape, dtype=dtype)
        self.read_range(kind, name, dim, 0, shape[dim], shape, out)
        self.finish()
        return out

    def read_local(
        self, shard: ParamShard, kind: str, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """This rank's local tensor of `shard` (its pieces concatenated)."""
        out = torch.empty(shard.local_shape, dtype=dtype)
        for piece in shard.pieces:
            self.read_range(
                kind,
                shard.name,
                shard.dim,
                piece.global_start,
                piece.length,
                shard.shape,
                out.narrow(shard.dim, piece.local_start, piece.length),
            )
        return out

    def release(self) -> None:
        """Stop the checks not yet started, wait for those running (they read the mappings) and
        release the thread pool and the mapped files; never raises, so that error paths can call
        it without hiding their own error. Unfinished checks are dropped unreported."""
        self._pending = []
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._files.clear()
        self._tensors.clear()

    def close(self) -> None:
        """Finish the checks (raising a failure), then release the files."""
        try:
            self.finish()
        finally:
            self.release()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Leaving normally reports the checks (`close`); leaving on an error only releases."""
        if exc_type is None:
            self.close()
        else:
            self.release()


def read_full_model(
    load_dir: str, step: int | None = None
) -> tuple[Checkpoint, ModelSpec, dict[str, torch.Tensor]]:
    """(Checkpoint, ModelSpec, {canonical name: full tensor}) of a checkpoint, one process."""
    from planner.models import model_from_dict

    with Checkpoint(load_dir, step) as ckpt:
        model = model_from_dict(ckpt.meta["model"], f"{ckpt.dir}/{METADATA}: model")
        tensors = {s.name: ckpt.read_full(s.name, s.shape, s.dim) for s in canonical_shards(model)}
    return ckpt, model, tensors


def checkpoint_exists(load_dir: str) -> bool:
    """True if DIR holds a pointer or any checkpoint directory (used by --hetero-load-if-exists)."""
    if not os.path.isdir(load_dir):
        return False
    return any(
        n == TRACKER or n.startswith("iter_") or n == "release" for n in os.listdir(load_dir)
    )


class Loaded(NamedTuple):
    """What `load` restored. RNG states come back only under the plan that saved them (a rank
    of another plan draws other numbers); with dropout 0 nothing depends on them."""

    iteration: int
    seconds: float
    optimizer: bool  # Adam moments and step
    rng: bool


def load(trainer: Trainer, config: CheckpointConfig, verify: bool = True) -> Loaded:
    """Load `config.load` (a CheckpointConfig, megatron_hexi.config) into the trainer
    (collective) and say what was restored (Loaded). Every check, verification included, runs
    before the status exchange, so every rank raises the same CheckpointError; `verify=False`
    only serves to measure what verification costs."""
    start = time.perf_counter()
    plan = trainer.plan
    finetune = config.finetune
    load_optim = not (finetune or config.no_load_optim)
    load_rng = not (finetune or config.no_load_rng)
    error, ckpt, notes = None, None, []
    moments = rng_restored = False
    try:
        # The checks run while the trainer is filled and are reported on leaving the `with`
        # (Checkpoint._verified_slice: a failed load leaves the trainer unusable).
        with Checkpoint(config.load, config.ckpt_step, verify=verify) as ckpt:
            ckpt.check_model(plan.model)
            saved_gbs = ckpt.meta.get("global_batch_size")
            if (
                not finetune
                and ckpt.iteration
                and saved_gbs is not None
                and saved_gbs != plan.global_batch_size
            ):
                raise CheckpointError(
                    f"{ckpt.dir}: saved with global batch size {saved_gbs}, this plan has "
                    f"{plan.global_batch_size}: the data position (global batch i = samples "
                    f"[i x G, (i + 1) x G)) cannot continue; use --finetune to start at "
                    f"iteration 0 from these weights"
                )
            with torch.no_grad():
                for shard, param in trainer.params:
                    param.copy_(ckpt.read_local(shard, "param", param.dtype))
                moments = load_optim and ckpt.has_optimizer_state
                restore_optimizer(trainer, ckpt, ckpt.meta["adam_step"] if moments else None)
        if load_optim and not moments:
            notes.append("no optimizer state in the checkpoint: Adam starts fresh")
        meta_path = os.path.join(ckpt.dir, METADATA)
        if not finetune and ckpt.meta["scheduler"]:
            try:
                _load_scheduler(trainer.scheduler, ckpt.meta["scheduler"], config)
            except CheckpointError:
                raise
            except Exception as e:  # noqa: BLE001 - a key missing or of the wrong type
                raise CheckpointError(
                    f"{meta_path}: scheduler: malformed ({type(e).__name__}: {e})"
                )
        same_plan = (ckpt.meta["plan"] or {}).get("pipelines") == plan.to_dict()["pipelines"]
        if load_rng and ckpt.meta["rng"]:
            if same_plan and str(trainer.rank) in ckpt.meta["rng"]:
                try:
                    set_rng_state(ckpt.meta["rng"][str(trainer.rank)])
                    rng_restored = True
                except Exception as e:  # noqa: BLE001
                    raise CheckpointError(
                        f"{meta_path}: rng.{trainer.rank}: malformed ({type(e).__name__}: {e})"
                    )
            else:
                notes.append(
                    "RNG states not restored: the checkpoint's plan differs (RNGs stay "
                    "seeded from --seed)"
                )
    except CheckpointError as e:
        error = str(e)
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"
    _agree(error, f"loading checkpoint {config.load}")

    iteration = 0 if finetune else ckpt.iteration
    seconds = time.perf_counter() - start
    if dist.get_rank() == 0:
        print(
            f" loaded checkpoint from {ckpt.dir} at iteration {iteration} in {seconds:.3f} s"
            + "".join(f"; {n}" for n in notes),
            flush=True,
        )
    return Loaded(iteration, seconds, moments, rng_restored)


def _load_scheduler(
    scheduler: OptimizerParamScheduler, saved: dict[str, Any], config: CheckpointConfig
) -> None:
    """Megatron's rule: the run's schedule must match the checkpoint's (one clear error naming
    the field) unless --override-opt_param-scheduler or --use-checkpoint-opt_param-scheduler."""
    mine = scheduler.state_dict()
    if config.override_opt_param_scheduler:
        scheduler.override_opt_param_scheduler = True
    elif config.use_checkpoint_opt_param_scheduler:
        scheduler.use_checkpoint_opt_param_scheduler = True
    else:
        ignored = {"num_steps"} | (
            {"wd_incr_steps"} if mine.get("wd_incr_style") == "constant" else set()
        )
        diff = [
            f"{k}: checkpoint {saved[k]!r}, this run {mine[k]!r}"
            for k in mine
            if k not in ignored and k in saved and saved[k] != mine[k]
        ]
        if diff:
            raise CheckpointError(
                f"--load {config.load}: the learning-rate schedule differs from the checkpoint's "
                f"({'; '.join(diff)}); give the same --lr/--min-lr/--lr-*/--train-iters, or "
                f"--use-checkpoint-opt_param-scheduler / --override-opt_param-scheduler"
            )
        saved = {**saved, "wd_incr_steps": mine["wd_incr_steps"]}
    scheduler.load_state_dict(saved)


# ------------------------------------------------------------------------------ optimizer state
# The only functions that know how optimizer state is held. Two layouts:
# * megatron-core's FP32Optimizer / Float16Optimizer: torch AdamW state per local parameter (the
#   parameter itself in fp32, an fp32 master copy under bf16); this rank writes the segments
#   that writer_segments() gives it;
# * the distributed optimizer (megatron_hexi.distributed_optimizer): fp32 master weights and
#   Adam state per MasterPart, a canonical range owned by exactly one rank; each rank writes its
#   parts.
# Either way the files hold canonical ranges, so either optimizer loads what the other saved.


def _is_sharded(optimizer: MegatronOptimizer) -> bool:
    return hasattr(optimizer, "parts") and hasattr(optimizer, "all_gather_params")


def _main_params(optimizer: MegatronOptimizer) -> dict[int, torch.Tensor]:
    """{id(model parameter): the fp32 tensor the optimizer updates (itself in fp32 training)}."""
    if hasattr(optimizer, "float16_groups"):
        out = {}
        for g16, g32 in zip(optimizer.float16_groups, optimizer.fp32_from_float16_groups):
            out.update({id(a): b for a, b in zip(g16, g32)})
        for group in optimizer.fp32_from_fp32_groups:
            out.update({id(a): a for a in group})
        return out
    return {id(p): p for g in optimizer.param_groups for p in g["params"]}


def _state(optimizer: MegatronOptimizer) -> dict[torch.Tensor, dict[str, Any]]:
    return optimizer.optimizer.state  # torch AdamW inside megatron-core's wrapper


def _with_moments(
    tensors: dict[str, torch.Tensor], state: Mapping[str, Any] | None
) -> dict[str, torch.Tensor]:
    if state:
        tensors.update(exp_avg=state["exp_avg"], exp_avg_sq=state["exp_avg_sq"])
    return tensors


def owned_ranges(trainer: Trainer) -> list[OwnedRange]:
    """[(name, dim, canonical shape, global start, {kind: tensor})]: what this rank writes."""
    opt = trainer.optimizer
    shapes = {shard.name: shard.shape for shard, _ in trainer.params}
    state = _state(opt)
    if _is_sharded(opt):
        return [
            (
                p.name,
                p.dim,
                shapes[p.name],
                p.global_start,
                _with_moments({"param": p.master}, state.get(p.master)),
            )
            for p in opt.parts
            if p.length
        ]
    main = _main_params(opt)
    out = []
    for shard, param, local_start, global_start, length in local_runs(
        trainer.params, writer_segments(trainer.plan)[trainer.rank]
    ):
        mp = main[id(param)]
        tensors = _with_moments({"param": mp}, state.get(mp))
        out.append(
            (
                shard.name,
                shard.dim,
                shard.shape,
                global_start,
                {k: t.narrow(shard.dim, local_start, length) for k, t in tensors.items()},
            )
        )
    return out


def _adam_steps(optimizer: MegatronOptimizer) -> set[int]:
    """The set of Adam step counts over this rank's optimizer state (empty before step 1)."""
    return {int(float(s["step"])) for s in _state(optimizer).values() if "step" in s}


@torch.no_grad()
def restore_optimizer(trainer: Trainer, ckpt: Checkpoint, adam_step: int | None) -> None:
    """Fill the fp32 master weights from the checkpoint's params and, if adam_step is not None,
    Adam's moments and step; otherwise the optimizer state stays empty (fresh Adam)."""
    opt = trainer.optimizer
    state = _state(opt)

    def moments(
        name: str, dim: int, shape: Sequence[int], start: int, like: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        out = {}
        for kind in KINDS[1:]:
            t = torch.empty(like.shape, dtype=torch.float32)
            ckpt.read_range(kind, name, dim, start, like.shape[dim], shape, t)
            out[kind] = t.to(like.device, like.dtype)
        return {"step": step_state(adam_step, like, opt.optimizer), **out}

    if _is_sharded(opt):
        shapes = {shard.name: shard.shape for shard, _ in trainer.params}
        for p in opt.parts:
            if not p.length:
                continue
            value = torch.empty(p.master.shape, dtype=torch.float32)
            ckpt.read_range("param", p.name, p.dim, p.global_start, p.length, shapes[p.name], value)
            p.master.copy_(value)
            if adam_step is not None:
                state[p.master] = moments(p.name, p.dim, shapes[p.name], p.global_start, p.master)
        return
    main = _main_params(opt)
    for shard, param in trainer.params:
        mp = main[id(param)]
        if mp is not param:
            mp.copy_(ckpt.read_local(shard, "param"))
        if adam_step is not None:
            st = {"step": step_state(adam_step, mp, opt.optimizer)}
            for kind in KINDS[1:]:
                st[kind] = ckpt.read_local(shard, kind).to(mp.device, mp.dtype)
            state[mp] = st


# ------------------------------------------------------------------------------------ RNG state


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().contiguous().numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def rng_state() -> dict[str, Any]:
    """This process's RNG states, JSON-ready: torch CPU, CUDA, megatron's tracker, Python, NumPy."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    np_state = np.random.get_state()
    py_state = random.getstate()
    cuda = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = _b64(torch.cuda.get_rng_state())
    return {
        "torch_cpu": _b64(torch.get_rng_state()),
        "cuda": cuda,
        "tracker": {
            k: _b64(_state_tensor(v)) for k, v in get_cuda_rng_tracker().get_states().items()
        },
        "python": [py_state[0], _b64_words(py_state[1]), py_state[2]],
        "numpy": [
            np_state[0],
            _b64_words(np_state[1]),
            int(np_state[2]),
            int(np_state[3]),
            float(np_state[4]),
        ],
    }


def _state_tensor(state: torch.Tensor | torch.Generator) -> torch.Tensor:
    """A tracker state as bytes: the graph-safe tracker (CUDA graphs) holds generators."""
    return state.get_state() if isinstance(state, torch.Generator) else state


def _into(held: object, saved: torch.Tensor) -> torch.Tensor | torch.Generator:
    """A saved tracker state for the tracker as it is: into its generator where it holds one
    (CUDA graphs register those generators), else the state tensor itself."""
    if isinstance(held, torch.Generator):
        held.set_state(saved)
        return held
    return saved


def _b64_words(words: npt.ArrayLike) -> str:
    return base64.b64encode(np.asarray(words, dtype=np.uint32).tobytes()).decode()


def _words(text: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), dtype=np.uint32)


def set_rng_state(state: Mapping[str, Any]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(_unb64(state["torch_cpu"]))
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state(_unb64(state["cuda"]))
    tracker = get_cuda_rng_tracker()
    held = tracker.get_states()
    tracker.set_states({k: _into(held.get(k), _unb64(v)) for k, v in state["tracker"].items()})
    py = state["python"]
    random.setstate((py[0], tuple(int(w) for w in _words(py[1])), py[2]))
    n = state["numpy"]
    np.random.set_state((n[0], _words(n[1]).copy(), n[2], n[3], n[4]))
