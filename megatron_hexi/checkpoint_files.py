"""The names a checkpoint folder holds, and how a save recognises what it wrote itself.

A save touches only its own entries of the folder: the pointer
(`latest_checkpointed_iteration.txt`), iteration folders (`iter_0000012`, `release`) and their
temporary folders (`.iter_0000012.tmp`, `.iter_0000012.tmp.old`). Other tools use the same names
(Megatron-LM writes the same pointer and iteration folders), and a user may keep anything there,
so a name alone proves nothing: a folder is this project's when it holds the marker file every
save writes first (SAVE_MARKER), or, for saves made before the marker existed, a checkpoint.json
that starts with this project's format key.

The pointer is read only as a regular file inside the folder, at most POINTER_BYTES long, and its
content never appears in an error: a pointer that is a symbolic link to another file must not
turn that file's first line into a message.
"""

from __future__ import annotations

import errno
import os
import re
import stat

from planner.errors import SpecError

FORMAT = "megatron-hexi-checkpoint"
TRACKER = "latest_checkpointed_iteration.txt"
METADATA = "checkpoint.json"
# Written first into every temporary save folder (it stays in the iteration folder it becomes).
SAVE_MARKER = ".megatron-hexi-save"
ITERATION_DIR = re.compile(r"iter_(\d{7,})|release")
TEMPORARY_DIR = re.compile(r"\.(?:iter_\d{7,}|release)\.tmp(?:\.old)?")
POINTER_BYTES = 64
# checkpoint.json is written with json.dump(indent=1), "format" first: its first bytes say whose.
_META_HEAD = re.compile(rb'\s*\{\s*"format"\s*:\s*"' + FORMAT.encode() + rb'"')


class CheckpointError(SpecError):
    """A missing, corrupt or incompatible checkpoint: one line naming the file or the field."""


def is_real_dir(path: str) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def is_regular(path: str) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def is_own(path: str) -> bool:
    """True if `path` is a real folder (not a symbolic link) that a save of this project wrote:
    it holds SAVE_MARKER, or a checkpoint.json in this project's format."""
    if not is_real_dir(path):
        return False
    if is_regular(os.path.join(path, SAVE_MARKER)):
        return True
    meta = os.path.join(path, METADATA)
    if not is_regular(meta):
        return False
    try:
        with open(meta, "rb") as f:
            return bool(_META_HEAD.match(f.read(256)))
    except OSError:
        return False


def mark_own(tmp_dir: str) -> None:
    """Mark a temporary save folder as this project's (before anything else goes into it)."""
    with open(os.path.join(tmp_dir, SAVE_MARKER), "w") as f:
        f.write(FORMAT + "\n")


def read_pointer(folder: str) -> str | None:
    """The pointer's text (stripped), None when there is none. CheckpointError, naming the file
    but never its content, when it is not a regular file inside `folder` or is too long."""
    path = os.path.join(folder, TRACKER)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})")
    if stat.S_ISLNK(st.st_mode):
        raise CheckpointError(
            f"{path}: is a symbolic link; the pointer must be a regular file inside {folder}"
        )
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{path}: is not a regular file")
    if st.st_size > POINTER_BYTES:
        raise CheckpointError(
            f"{path}: corrupt ({st.st_size} bytes; expected an iteration number or 'release')"
        )
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            data = os.read(fd, POINTER_BYTES + 1)
        finally:
            os.close(fd)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})")
    try:
        return data.decode("ascii").strip()
    except UnicodeDecodeError:
        raise CheckpointError(f"{path}: corrupt (expected an iteration number or 'release')")


def parse_pointer(text: str, path: str) -> int | None:
    """The iteration a pointer's text names (None: `release`)."""
    if text == "release":
        return None
    if text.isdigit() and len(text) <= 18:
        return int(text)
    raise CheckpointError(f"{path}: corrupt (expected an iteration number or 'release')")


def pointed(folder: str) -> tuple[bool, int | None]:
    """(whether there is a pointer, the iteration it names; None for `release`)."""
    text = read_pointer(folder)
    if text is None:
        return False, None
    return True, parse_pointer(text, os.path.join(folder, TRACKER))


def iteration_of(name: str) -> int | None:
    """The iteration of an iteration folder's name (None: `release`)."""
    m = ITERATION_DIR.fullmatch(name)
    return int(m.group(1)) if m and m.group(1) else None


def is_loop(path: str) -> bool:
    """True if resolving `path` meets a symbolic link loop."""
    try:
        os.stat(path)
    except OSError as e:
        return e.errno == errno.ELOOP
    return False


__all__ = [
    "FORMAT",
    "TRACKER",
    "METADATA",
    "SAVE_MARKER",
    "ITERATION_DIR",
    "TEMPORARY_DIR",
    "CheckpointError",
    "is_own",
    "mark_own",
    "read_pointer",
    "parse_pointer",
    "pointed",
    "iteration_of",
    "is_real_dir",
    "is_regular",
    "is_loop",
]


def megatron_lm_layout(folder: str) -> str | None:
    """The Megatron-LM checkpoint layout `folder` holds ('torch_dist' or legacy 'torch'), or
    None: what to suggest when a Megatron-LM save is given to --load."""
    if os.path.isfile(os.path.join(folder, "metadata.json")) and os.path.isfile(
        os.path.join(folder, "common.pt")
    ):
        return "torch_dist"
    try:
        names = os.listdir(folder)
    except OSError:
        return None
    return "torch" if any(n.startswith("mp_rank_") for n in names) else None
