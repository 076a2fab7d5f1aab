"""Reading a checkpoint: checkpoint.json checked key by key (`check_meta`), rank files checked
against it, and ranges of canonical tensors read from whichever files hold them (`Checkpoint`),
each block a read overlaps verified against its checksum on a few threads.

Loading (--load under any plan, export, tests) refuses, with one error naming the file and the
key or tensor:
  * a checkpoint.json with a missing or malformed key, an iteration that is not the one its
    directory and pointer name, or content that does not match its own checksum (edited);
  * a rank file of another save (iteration or save id differ from checkpoint.json's) or whose
    tensor list differs from checkpoint.json's;
  * a block of a tensor that does not match its checksum (naming the block and its bytes), or a
    slice read that holds NaN or inf.
Damage in bytes that a rank does not read goes unseen by that rank: nothing wrong was loaded.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from megatron_hexi.checkpoint.format import (
    FORMAT_VERSION,
    ITEMSIZE,
    KINDS,
    NOT_COMPARED,
    RANK_FILE,
    entry_key,
    is_kind,
    iteration_dir_name,
    tensor_bytes,
)
from megatron_hexi.checkpoint.integrity import (
    CHECKSUM,
    HEX32,
    blocks_bytes,
    crc32_hex,
    meta_checksum,
    non_finite,
    overlapping_blocks,
)
from megatron_hexi.checkpoint_files import (
    FORMAT,
    ITERATION_DIR,
    METADATA,
    TRACKER,
    CheckpointError,
    is_own,
    is_real_dir,
    is_regular,
    iteration_of,
    megatron_lm_layout,
    pointed,
)
from planner.errors import SpecError
from planner.layout import canonical_shards

if TYPE_CHECKING:
    from types import TracebackType

    from safetensors import safe_open

    from planner.layout import ParamShard
    from planner.models import ModelSpec

# Most threads per process that verify a load's blocks (CRC-32 and the NaN/inf check): torchrun
# starts one process per GPU, and each should leave the node's other cores to the other ranks.
VERIFY_THREADS = 4


def _cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


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
    (
        "kind",
        is_kind,
        f"one of {', '.join(KINDS)}, momentum_buffer (island<k>. before them), or outer_*",
    ),
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
            if megatron_lm_layout(self.dir):
                raise CheckpointError(
                    f"{self.dir}: a Megatron-LM checkpoint ({megatron_lm_layout(self.dir)}), not "
                    f"one of this runtime: convert it with `hexi-convert import-megatron --load "
                    f"{load_dir} --output NEW` and load NEW"
                )
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
        self.index: dict[tuple[str, str], list[tuple[str, dict[str, Any]]]] = {}
        for fname, rows in self.meta["files"].items():
            for row in rows:
                self.index.setdefault((row["kind"], row["name"]), []).append((fname, row))
        self._files: dict[str, safe_open] = {}
        # (file, key): (mapped tensor, its bytes, blocks whose checks started)
        self._tensors: dict[tuple[str, str], tuple[torch.Tensor, np.ndarray, np.ndarray]] = {}
        self._pending: list[Future[None]] = []  # the checks, in reading order
        self._pool: ThreadPoolExecutor | None = None
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
            state = (full, full.reshape(-1).view(torch.uint8).numpy(), np.zeros(nblocks, bool))
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
            digest = crc32_hex(flat[lo:hi])
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


def last_loadable(folder: str) -> str | None:
    """'iteration N' (or 'release') of the newest checkpoint in `folder` that opens and names
    every file it lists, preferring the one the pointer names; None if there is none. For
    messages after a failure or an interrupt: it reads checkpoint.json, not the tensors."""

    def opens(step: int | None) -> bool:
        try:
            ckpt = Checkpoint(folder, step, verify=False)
        except (SpecError, OSError, RecursionError, ValueError):
            return False
        return all(is_regular(os.path.join(ckpt.dir, f)) for f in ckpt.meta["files"])

    def label(step: int | None) -> str:
        return "release" if step is None else f"iteration {step}"

    if not is_real_dir(folder):
        return None
    try:
        has, step = pointed(folder)
    except CheckpointError:
        has, step = False, None
    if has and opens(step):
        return label(step)
    try:
        names = os.listdir(folder)
    except OSError:
        return None
    found = sorted(
        (iteration_of(n) or 0 for n in names if ITERATION_DIR.fullmatch(n)), reverse=True
    )
    for it in found:
        if it and is_own(os.path.join(folder, f"iter_{it:07d}")) and opens(it):
            # not the pointer's: loading it needs --ckpt-step
            return label(it or None) + (f" (--ckpt-step {it})" if it else "")
    return None
