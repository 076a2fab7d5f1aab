"""An output folder written whole or not at all, for tools that write a folder of files.

The files are written into a new hidden folder beside the output, then renamed to its name: a
failed run leaves the output as it was, and a successful one leaves only what it wrote (no stale
shard, index or iteration of an earlier content). A folder that is not empty is refused unless the
user says --overwrite, and never when it is, or holds, one of the run's inputs.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from planner.errors import SpecError


def _inside(path: str, folder: str) -> bool:
    return os.path.commonpath([path, folder]) == folder


def check_output(
    output: str, flag: str, overwrite: bool, inputs: Sequence[tuple[str, str]] = ()
) -> str:
    """The output folder's absolute path; SpecError if it may not be written or replaced.
    `inputs`: (flag, path) of what the run reads, which the output must not be or hold."""
    out = os.path.abspath(output)
    if os.path.islink(out):
        raise SpecError(
            f"{flag} {output}: is a symbolic link; give the folder it points to "
            f"({os.path.realpath(out)})"
        )
    if os.path.lexists(out) and not os.path.isdir(out):
        raise SpecError(f"{flag} {output}: exists and is not a folder")
    real = os.path.realpath(out)
    for in_flag, path in inputs:
        if _inside(os.path.realpath(path), real):
            raise SpecError(
                f"{flag} {output}: is or holds {in_flag} {path}; write the output elsewhere "
                f"(replacing it would delete the input)"
            )
    if os.path.isdir(out):
        try:
            held = sorted(os.listdir(out))
        except OSError as e:
            raise SpecError(f"{flag} {output}: cannot read ({e.strerror})") from None
        if held and not overwrite:
            shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
            raise SpecError(
                f"{flag} {output}: folder is not empty (it holds {shown}); give a new or empty "
                f"folder, or --overwrite to replace it whole"
            )
    return out


@contextmanager
def replaced_folder(out: str, flag: str) -> Iterator[str]:
    """A new folder beside `out` (as checked by check_output) to write into; renamed to `out`
    (replacing what was there) when the block ends without an exception, else removed."""
    parent = os.path.dirname(out)
    try:
        os.makedirs(parent, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.", suffix=".tmp", dir=parent)
    except OSError as e:
        raise SpecError(f"{flag} {out}: cannot write there ({e.strerror})") from None
    os.chmod(staging, 0o777 & ~_umask())
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    old = None
    try:
        if os.path.isdir(out):
            old = staging + ".old"
            os.rename(out, old)
        os.rename(staging, out)
    except OSError as e:
        if old is not None and not os.path.lexists(out):
            os.rename(old, out)
        shutil.rmtree(staging, ignore_errors=True)
        raise SpecError(f"{flag} {out}: cannot replace it ({e.strerror})") from None
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def write_file_atomically(path: str, text: str | None, flag: str, overwrite: bool) -> None:
    """Write a single file through a temporary name; an existing file only with --overwrite.
    `text` None: only check that it may be written."""
    if os.path.lexists(path) and not (overwrite and os.path.isfile(path)):
        raise SpecError(
            f"{flag} {path}: "
            + (
                "exists; give a new file name, or --overwrite to replace it"
                if os.path.isfile(path) and not os.path.islink(path)
                else "exists and is not a regular file"
            )
        )
    if text is None:
        return
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(
            prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=os.path.dirname(path) or "."
        )
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None and os.path.lexists(tmp):
            os.remove(tmp)
        raise SpecError(f"{flag} {path}: cannot write ({e.strerror})") from None
