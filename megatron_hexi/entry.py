"""pretrain_gpt.py's entry: the whole command line is checked (flags together, then against a
plan file) before torch and megatron-core are imported, so --help and every refusal take a
fraction of a second and come as one message; then megatron_hexi.training runs it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import NoReturn

from megatron_hexi.arguments import check_command_line
from megatron_hexi.process_exit import exit_process
from megatron_hexi.report import error_lines
from megatron_hexi.start_time import STARTED
from planner.errors import SpecError

__all__ = ["STARTED", "cli"]  # STARTED: taken at the entry's import, before the check


def cli(argv: Sequence[str] | None = None) -> NoReturn:
    """Check the command line (exit 2 with every problem, one per line), then train
    (megatron_hexi.training.main) and end the process with its code."""
    try:
        checked = check_command_line(argv)
    except SpecError as e:
        for line in error_lines(e.problems):
            print(line, file=sys.stderr, flush=True)
        exit_process(2)
    from megatron_hexi.training import main

    exit_process(main(argv, checked))
