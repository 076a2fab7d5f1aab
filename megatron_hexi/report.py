"""How a run's errors and names reach the log: one line each, printed once, never raw.

* A name that comes from outside (a node name from HEXI_PLAN_NODE, a host name) is shown with
  control characters escaped and cut to SHOWN_CHARS, so that a newline or an ANSI escape in it
  cannot forge or repaint log lines (`shown`).
* Every error line is escaped the same way, so one problem is always one line (`error_lines`).
* An error that every rank found together (after an all-gather, or from the same collective
  result) is an AgreedError: every rank stops with exit code 2, and only launch rank 0 prints
  it, instead of one copy per rank in the launcher's merged output.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

from planner.errors import SpecError

PROGRAM = "pretrain_gpt.py"
SHOWN_CHARS = 64
# C0 and C1 controls, DEL, and the Unicode line and paragraph separators
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


class AgreedError(SpecError):
    """The same problems on every rank (agreed through a collective): printed by launch rank 0."""


def escaped(text: str) -> str:
    """`text` with control characters written as Python escapes (\\n, \\x1b)."""
    return _CONTROL.sub(lambda m: ascii(m.group())[1:-1], text)


def shown(name: object, limit: int = SHOWN_CHARS) -> str:
    """A name for a log line: escaped, and cut to `limit` characters with '...' and its length."""
    text = escaped(str(name))
    if len(text) > limit:
        return f"{text[:limit]}... ({len(text)} characters)"
    return text


def launch_rank() -> int:
    """This process's launch rank: the process group's, else the launcher's RANK."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def error_lines(problems: Sequence[object]) -> list[str]:
    """The stderr lines of a SpecError's problems, escaped."""
    return [f"{PROGRAM}: error: {escaped(str(p))}" for p in problems]


def prints(error: SpecError) -> bool:
    """Whether this process prints `error`: always, unless every rank has the same one."""
    return not isinstance(error, AgreedError) or launch_rank() == 0


__all__ = [
    "AgreedError",
    "escaped",
    "shown",
    "launch_rank",
    "error_lines",
    "prints",
    "SHOWN_CHARS",
]
