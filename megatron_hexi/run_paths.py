"""Where a run writes, checked at start-up: a run touches only what it wrote, and finds an
unusable output path before the first step rather than at the first write (or never: a FIFO
blocks forever, a read-only wandb folder silently became a folder under the system temp dir).

`check_run_paths` is collective. Each rank checks the paths it writes: every rank `--save` (its
rank file), launch rank 0 the checkpoint folder's content, `--hetero-metrics-path` and
`--tensorboard-dir`, the last launch rank the wandb folder. One all-gather shares the problems,
and every rank stops with the same AgreedError, which launch rank 0 prints.

The checkpoint folder (`--save`). A save writes and removes only its own entries
(megatron_hexi.checkpoint_files says how it knows them). Anything else under a name a save would
use (a Megatron-LM `iter_0000002/`, a user's `.iter_0000001.tmp/`, a pointer naming a folder that
is not this project's) is refused, so nothing of it is ever replaced, moved back or removed; other
names (a TensorBoard folder, notes) are left alone. A run that does not continue the folder's
latest checkpoint would replace its later iterations and move its pointer back, so it is refused
too, and so is `--finetune` from the folder it saves to.

Output files and folders must not be an input of the run (the plan, cluster or model file) or
lie among a checkpoint's own entries, must be a regular file (metrics) or a folder (TensorBoard,
wandb) with no symbolic link loop, and must be writable by this process.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Sequence
from typing import TYPE_CHECKING

from megatron_hexi.checkpoint_files import (
    ITERATION_DIR,
    TEMPORARY_DIR,
    TRACKER,
    CheckpointError,
    is_loop,
    is_own,
    pointed,
)
from megatron_hexi.report import AgreedError, shown
from planner.errors import SpecError

if TYPE_CHECKING:
    from megatron_hexi.config import CheckpointConfig, RunConfig

PLANS_DIR = "plans"  # megatron_hexi.startup_plan keeps start-up plans there


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a regular file"


def _same(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def _among_checkpoint_files(path: str, folders: Sequence[str]) -> str | None:
    """The checkpoint entry (pointer, iteration or temporary folder, plans) of one of `folders`
    that `path` is or lies inside, or None."""
    real = os.path.realpath(path)
    for folder in folders:
        rel = os.path.relpath(real, os.path.realpath(folder))
        if rel == os.curdir or rel.startswith(os.pardir):
            continue
        first = rel.split(os.sep)[0]
        if (
            first in (TRACKER, PLANS_DIR)
            or ITERATION_DIR.fullmatch(first)
            or TEMPORARY_DIR.fullmatch(first)
        ):
            return os.path.join(folder, first)
    return None


def _common(flag: str, path: str, inputs: Sequence[str], folders: Sequence[str]) -> str | None:
    where = f"{flag} {shown(path, 200)}"
    if is_loop(path):
        return f"{where}: a symbolic link loop"
    for given in inputs:
        if os.path.exists(path) and _same(path, given):
            return f"{where}: is {given}, an input of this run; it would be overwritten"
    entry = _among_checkpoint_files(path, folders)
    if entry:
        return f"{where}: lies among a checkpoint's own files ({entry}), which saves replace"
    return None


def _wrong_kind(flag: str, path: str, folder: bool) -> str | None:
    """Why an existing `path` is not the kind of entry the flag writes (absent is fine)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"{flag} {shown(path, 200)}: cannot use it ({e.strerror or e})"
    if folder and not stat.S_ISDIR(mode):
        return f"{flag} {shown(path, 200)}: is {_kind(mode)}, not a folder"
    if not folder and not stat.S_ISREG(mode):
        return f"{flag} {shown(path, 200)}: is {_kind(mode)}, not a regular file"
    return None


def file_problem(flag: str, path: str, inputs: Sequence[str], folders: Sequence[str]) -> str | None:
    """Why the output file `path` cannot be written, or None (it is created, empty, if absent)."""
    problem = _common(flag, path, inputs, folders) or _wrong_kind(flag, path, folder=False)
    if problem:
        return problem
    where = f"{flag} {shown(path, 200)}"
    try:
        # O_NONBLOCK: a FIFO put there since the check must not block the start-up
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o644)
        os.close(fd)
    except OSError as e:
        return f"{where}: cannot write there ({e.strerror or e})"
    return None


def folder_problem(
    flag: str, path: str, inputs: Sequence[str], folders: Sequence[str]
) -> str | None:
    """Why the output folder `path` cannot be written, or None (it is created if absent)."""
    problem = _common(flag, path, inputs, folders) or _wrong_kind(flag, path, folder=True)
    if problem:
        return problem
    where = f"{flag} {shown(path, 200)}"
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".hexi-write-check-"):
            pass
    except OSError as e:
        return f"{where}: cannot write there ({e.strerror or e})"
    if not os.access(path, os.R_OK | os.W_OK | os.X_OK):
        return f"{where}: not readable and writable by this process"
    return None


def save_folder_problems(ckpt: CheckpointConfig, first_iteration: int) -> list[str]:
    """Launch rank 0: why saving into `ckpt.save` could replace, move back or remove what the
    run did not write (nothing: an empty list). `first_iteration`: where this run starts."""
    save = ckpt.save
    assert save
    where = f"--save {shown(save, 200)}"
    if ckpt.finetune and ckpt.load and _same(ckpt.load, save):
        return [
            f"{where}: --finetune would save over the run it starts from (--load is the same "
            f"folder); give --save a folder of its own"
        ]
    if not os.path.isdir(save):
        return []  # created by the writability check; a file or a loop is named there
    try:
        names = sorted(os.listdir(save))
    except OSError as e:
        return [f"{where}: cannot list it ({e.strerror or e})"]
    foreign = []
    for name in names:
        path = os.path.join(save, name)
        if (ITERATION_DIR.fullmatch(name) or TEMPORARY_DIR.fullmatch(name)) and not is_own(path):
            foreign.append(name)
        elif name == PLANS_DIR and os.path.islink(path):
            foreign.append(f"{name} (a symbolic link)")
        elif name == PLANS_DIR and not os.path.isdir(path):
            foreign.append(f"{name} (not a folder)")
    try:
        has, step = pointed(save)
    except CheckpointError as e:
        return [f"{where}: {e}"]
    behind = None
    if has:
        folder = "release" if step is None else f"iter_{step:07d}"
        if not is_own(os.path.join(save, folder)):
            foreign.append(f"{TRACKER} (naming {folder})")
        elif step is not None and step > first_iteration:
            behind = step
    if foreign:
        more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        return [
            f"{where}: holds {', '.join(shown(n) for n in foreign[:3])}{more}, not written by "
            f"this project's saves, under names a save uses; saving there would replace, move "
            f"or remove them: give --save a folder of its own"
        ]
    if behind is not None:
        return [
            f"{where}: holds a run saved up to iteration {behind}; this run starts at "
            f"iteration {first_iteration} and would replace its later iterations and move its "
            f"pointer back: resume it with --load {shown(save, 200)}, or give --save another "
            f"folder"
        ]
    return []


def check_run_paths(config: RunConfig, inputs: Sequence[str], first_iteration: int) -> None:
    """Every output path of the run, on the ranks that write it (collective: every rank raises
    the same AgreedError). `inputs`: the run's input files (plan, cluster, model)."""
    import torch.distributed as dist

    from megatron_hexi import wandb_log

    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt, log = config.checkpoint, config.logging
    inputs = [p for p in inputs if p and os.path.isfile(p)]
    folders = [d for d in (ckpt.save, ckpt.load) if d]
    problems: list[str | None] = []  # None: no problem
    if ckpt.save:
        where = f"--save {shown(ckpt.save, 200)}"
        if is_loop(ckpt.save):
            problems.append(f"{where}: a symbolic link loop")
        else:
            try:
                os.makedirs(ckpt.save, exist_ok=True)
                with tempfile.NamedTemporaryFile(dir=ckpt.save, prefix=".hexi-write-check-"):
                    pass
            except OSError as e:
                problems.append(f"{where}: cannot write there ({e.strerror or e})")
            else:
                if rank == 0:
                    problems += save_folder_problems(ckpt, first_iteration)
    if rank == 0 and log.metrics_path:
        problems.append(file_problem("--hetero-metrics-path", log.metrics_path, inputs, folders))
    if rank == 0 and log.tensorboard_dir:
        problems.append(folder_problem("--tensorboard-dir", log.tensorboard_dir, inputs, folders))
    if rank == world - 1 and log.wandb_project:
        flag = "--wandb-save-dir" if log.wandb_save_dir else "--save (SAVE/wandb)"
        problems.append(folder_problem(flag, wandb_log.save_dir(log, ckpt.save), inputs, folders))
    everyone: list[list[str] | None] = [None] * world
    dist.all_gather_object(everyone, [p for p in problems if p])
    found = list(dict.fromkeys(p for mine in everyone for p in mine or []))
    if found:
        raise AgreedError(found)


class MetricsFile:
    """The JSONL metrics file of launch rank 0. A write that fails (a full disk) is one line
    naming the file, not a traceback."""

    def __init__(self, path: str, append: bool) -> None:
        self.path = path
        flags = os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | (os.O_APPEND if append else os.O_TRUNC)
        try:
            fd = os.open(path, flags, 0o644)
            os.set_blocking(fd, True)
            self._file = os.fdopen(fd, "w")
        except OSError as e:
            raise self._error("cannot open it", e)

    def _error(self, what: str, e: OSError) -> SpecError:
        return SpecError(f"--hetero-metrics-path {shown(self.path, 200)}: {what} ({e.strerror})")

    def write_line(self, text: str) -> None:
        try:
            self._file.write(text + "\n")
            self._file.flush()
        except OSError as e:
            raise self._error("cannot write a line", e)

    def close(self) -> None:
        try:
            self._file.close()
        except OSError:
            pass  # the failed write already said why


__all__ = [
    "check_run_paths",
    "save_folder_problems",
    "file_problem",
    "folder_problem",
    "MetricsFile",
]
