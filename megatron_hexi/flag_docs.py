"""docs/megatron-flags.md, written from the parser itself so that it cannot drift from it:

    python -m megatron_hexi.flag_docs > docs/megatron-flags.md

Each flag's status comes from the code: refused (megatron_hexi.refused_flags, or a help that
starts with "refused:"), accepted with no effect (megatron_hexi.plan_flags.ACCEPTED), checked
against the plan (megatron_hexi.arguments.NOT_IN_RUN_CONFIG: never reaches the runtime as a
value), or honoured (it sets a RunConfig field). tests/foundation/test_megatron_flags.py checks
that the file is this module's output.
"""

from __future__ import annotations

import argparse

from megatron_hexi.arguments import ISLAND_FLAGS, NOT_IN_RUN_CONFIG
from megatron_hexi.flags import build_parser
from megatron_hexi.plan_flags import ACCEPTED
from megatron_hexi.refused_flags import REFUSED_DESTS

HEAD = """# Megatron-LM's flags in pretrain_gpt.py

pretrain_gpt.py takes Megatron-LM's pretraining flags. A plan (hexi-plan) fixes the model, the
batch and the parallel layout, so those flags are optional and, when given, must say what the plan
says. Every problem of a command line (a bad value, an unknown or refused flag, a contradiction
with the plan file) is reported together, one line each, before torch is imported (exit code 2).
A flag that is in no table below is refused as unknown.

Status:

- **honoured**: it takes effect (a Megatron-LM flag as in Megatron-LM; the note says how).
- **checked against the plan**: it must agree with the plan (the plan decides; see each note).
- **accepted, no effect**: what it asks for is always so here, or does not apply (the note says).
- **refused**: an error that says why and what to use instead.
- **the plan itself**: where the plan comes from (this runtime's own flags).

This file is generated from the parser (`python -m megatron_hexi.flag_docs`); a test keeps it
current.
"""


PLAN_SOURCES = frozenset({"hetero_plan_path", "hetero_cluster", "hetero_model", *ISLAND_FLAGS})


def status(action: argparse.Action) -> str:
    """The flag's status, from the tables in the code (see the module docstring)."""
    if action.dest in PLAN_SOURCES:
        return "the plan itself"
    if action.dest in REFUSED_DESTS or (action.help or "").startswith("refused:"):
        return "refused"
    if action.dest in ACCEPTED:
        return "accepted, no effect"
    if action.dest in NOT_IN_RUN_CONFIG:
        return "checked against the plan"
    return "honoured"


def _note(action: argparse.Action, parser: argparse.ArgumentParser) -> str:
    formatter = parser._get_formatter()
    text = formatter._expand_help(action) if action.help else ""
    if action.dest in ACCEPTED:
        text = ACCEPTED[action.dest]
    for prefix in ("refused: ", "accepted: "):
        text = text.removeprefix(prefix)
    return " ".join(text.split()).replace("|", "\\|")


def rows(parser: argparse.ArgumentParser | None = None) -> list[tuple[str, str, str, str]]:
    """(group, flag, status, note) for every flag but --help, in --help's order."""
    parser = parser or build_parser()
    out = []
    for group in parser._action_groups:
        for action in group._group_actions:
            if not action.option_strings or action.dest == "help":
                continue
            title = (group.title or "").split(" (")[0]
            out.append((title, action.option_strings[0], status(action), _note(action, parser)))
    return out


def markdown() -> str:
    lines = [HEAD]
    current = None
    for group, flag, state, note in rows():
        if group != current:
            lines += ["", f"## {group}", "", "| flag | status | here |", "| --- | --- | --- |"]
            current = group
        lines.append(f"| `{flag}` | {state} | {note} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
