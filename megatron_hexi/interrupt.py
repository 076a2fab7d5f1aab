"""SIGINT (Ctrl-C): one line saying so and naming the last checkpoint that loads, not a
KeyboardInterrupt traceback from every rank.

torchrun and srun pass the interrupt on to every worker, so every rank receives it: each leaves at
once with exit code 130 (128 + SIGINT, the shell's convention), and launch rank 0 alone prints the
line. A rank that learns of the interrupt through a failed collective (a peer left first) reports
the interrupt too, not the collective failure. Nothing is saved: an interrupt that should save
first is SIGTERM with --exit-signal-handler.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import types
from typing import Any, NoReturn

from megatron_hexi.report import PROGRAM, launch_rank, shown

EXIT_CODE = 128 + signal.SIGINT


class _State:
    received = False
    previous: Any = None
    installed = False


def _handle(signum: int, frame: types.FrameType | None) -> None:
    if _State.received:  # a second Ctrl-C while the first is reported
        return
    _State.received = True
    raise KeyboardInterrupt


def install() -> None:
    """Handle SIGINT from now on (only the main thread can; elsewhere this does nothing)."""
    _State.received = False
    if threading.current_thread() is threading.main_thread():
        _State.previous = signal.signal(signal.SIGINT, _handle)
        _State.installed = True


def restore() -> None:
    """Put back the handler `install` replaced (a caller that goes on after `main`)."""
    if _State.installed:
        signal.signal(signal.SIGINT, _State.previous)
        _State.installed = False


def received() -> bool:
    return _State.received


def line(save: str | None) -> str:
    """The one line: the last checkpoint of --save that loads, and how to resume from it."""
    from megatron_hexi.checkpoint import last_loadable

    if not save:
        return f"{PROGRAM}: interrupted (SIGINT); nothing was saved (no --save)"
    found = last_loadable(save)
    if found is None:
        return f"{PROGRAM}: interrupted (SIGINT); no checkpoint that loads in {shown(save, 200)}"
    return (
        f"{PROGRAM}: interrupted (SIGINT); last checkpoint that loads: {found} in "
        f"{shown(save, 200)} (rerun with --load {shown(save, 200)} to resume)"
    )


def leave(save: str | None) -> NoReturn:
    """Print the line on launch rank 0 and end the process at once (a group whose peers are
    leaving too is not torn down: that can wait on them)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if launch_rank() == 0:
        try:
            print(line(save), file=sys.stderr, flush=True)
        except Exception:  # noqa: BLE001 - the line is a courtesy; the exit code must stay
            print(f"{PROGRAM}: interrupted (SIGINT)", file=sys.stderr, flush=True)
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    os._exit(EXIT_CODE)


__all__ = ["install", "restore", "received", "leave", "line", "EXIT_CODE"]
