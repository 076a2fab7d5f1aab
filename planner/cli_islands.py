"""The islands' flags of `hexi-plan manual` and `hexi-plan plan`: --islands and --outer-*.

`manual` takes islands as a JSON file (a list of pipeline-index lists); `plan` takes a mode
(off, sites, auto). Both take the outer step's settings (planner.islands.OuterSettings). Every
bad value is one line naming its flag.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from planner.errors import SpecError
from planner.inputs import read_json
from planner.islands import (
    MAX_OUTER_INTERVAL,
    OUTER_COMPRESSIONS,
    OUTER_OPTIMIZERS,
    OuterSettings,
    islands_problems,
    outer_from_dict,
    outer_problems,
)
from planner.search_islands import DEFAULT_MAX_INTERVAL, ISLAND_MODES, IslandRequest

if TYPE_CHECKING:
    from planner.plan import Plan

_OUTER_FLAGS = {
    "interval": "--outer-interval",
    "optimizer": "--outer-optimizer",
    "lr": "--outer-lr",
    "momentum": "--outer-momentum",
    "compression": "--outer-compression",
    "fragments": "--outer-fragments",
}
_D = OuterSettings(interval=1)


def add_outer_flags(p: argparse._ActionsContainer, interval_help: str, prefix: str = "") -> None:
    """--outer-interval, --outer-optimizer, --outer-lr, --outer-momentum, --outer-compression,
    --outer-fragments (planner.islands' fields of `training.outer`); `prefix` leads each help."""
    p.add_argument("--outer-interval", type=str, default=None, help=prefix + interval_help)
    p.add_argument(
        "--outer-optimizer",
        default=None,
        help=f"{prefix}outer optimizer: {', '.join(OUTER_OPTIMIZERS)} (default: {_D.optimizer})",
    )
    p.add_argument(
        "--outer-lr",
        default=None,
        help=f"{prefix}outer learning rate in (0, 100] (default: {_D.lr})",
    )
    p.add_argument(
        "--outer-momentum",
        default=None,
        help=f"{prefix}outer momentum in [0, 1) (default: {_D.momentum})",
    )
    p.add_argument(
        "--outer-compression",
        default=None,
        help=f"{prefix}what crosses islands: {', '.join(OUTER_COMPRESSIONS)} "
        f"(default: {_D.compression})",
    )
    p.add_argument(
        "--outer-fragments",
        default=None,
        help=f"{prefix}layers cut into this many fragments, each synced at its own step and "
        f"overlapped with the next step's forward and backward (default: {_D.fragments})",
    )


def add_island_flags(p: argparse._ActionsContainer, prefix: str = "") -> None:
    """--islands, --outer-max-comm-share and the --outer-* flags of `hexi-plan plan` (and, with
    `prefix` leading each help, of the runtime's start-up planning)."""
    p.add_argument(
        "--islands",
        choices=ISLAND_MODES,
        default="off",
        help=f"{prefix}off: one synchronous plan; sites: one island per site (each planned on "
        "its own, the batch split so that their steps take equal time, meeting every "
        "--outer-interval steps); auto: islands only where the synchronous gradient sync would "
        "take more than --outer-max-comm-share of the step (default: off)",
    )
    p.add_argument(
        "--outer-max-comm-share",
        type=comm_share,
        default=0.10,
        help=f"{prefix}with --islands: the largest share of the step the exposed outer sync may "
        "take (sets --outer-interval when not given), and for auto the share of the synchronous "
        "gradient sync above which islands are considered (default: 0.10)",
    )
    p.add_argument(
        "--outer-max-interval",
        type=max_interval,
        default=DEFAULT_MAX_INTERVAL,
        help=f"{prefix}with --islands: the largest --outer-interval chosen when none is given, "
        "even where the outer sync then takes more than --outer-max-comm-share (default: "
        f"{DEFAULT_MAX_INTERVAL}, the interval DiLoCo measured to train as well as synchronous "
        "training)",
    )
    add_outer_flags(
        p,
        "with --islands: inner steps between outer steps (default: the smallest that keeps the "
        "outer sync within --outer-max-comm-share, at most --outer-max-interval)",
        prefix,
    )


def comm_share(text: str) -> float:
    """An argparse type for --outer-max-comm-share: a fraction in (0, 1)."""
    try:
        value = float(text) if len(text) <= 40 else math.nan
    except ValueError:
        value = math.nan
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1), got {text[:40]!r}")
    return value


def max_interval(text: str) -> int:
    """An argparse type for --outer-max-interval: a positive integer."""
    try:
        value = int(text) if len(text) <= 40 else 0
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_OUTER_INTERVAL:
        raise argparse.ArgumentTypeError(
            f"must be an integer in [1, {MAX_OUTER_INTERVAL}], got {text[:40]!r}"
        )
    return value


def _number(text: str, flag: str, integer: bool) -> Any:
    try:
        return int(text) if integer else float(text)
    except ValueError:
        kind = "an integer" if integer else "a number"
        raise SpecError(f"{flag}: must be {kind}, got {text[:40]!r}")


def outer_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The `training.outer` fields the flags give (interval maybe absent), parsed, not checked."""
    out: dict[str, Any] = {}
    for key, flag in _OUTER_FLAGS.items():
        value = getattr(args, "outer_" + key)
        if value is None:
            continue
        if key in ("optimizer", "compression"):
            out[key] = value
        else:
            out[key] = _number(value, flag, key in ("interval", "fragments"))
    return out


def outer_settings(fields: dict[str, Any], num_layers: int) -> OuterSettings:
    """OuterSettings from `outer_fields` with an interval; SpecError naming the flag."""
    problems = outer_problems(fields, num_layers)
    if problems:
        lines = []
        for line in problems:
            for key, flag in _OUTER_FLAGS.items():
                line = line.replace(f"training.outer.{key}:", f"{flag}:")
            lines.append(line)
        raise SpecError(lines)
    return outer_from_dict(fields)


def island_request(args: argparse.Namespace, num_layers: int) -> IslandRequest:
    """What --islands, --outer-max-comm-share and the --outer-* flags ask of `plan` (and of the
    runtime's start-up planning): the --outer-* values checked, one line naming the flag,
    before any search."""
    fields = outer_fields(args)
    if fields and args.islands == "off":
        flag = _OUTER_FLAGS[next(iter(fields))]
        raise SpecError(
            f"{flag}: needs --islands sites or auto (plans without islands are synchronous)"
        )
    if fields:
        outer_settings({"interval": 1, **fields}, num_layers)
    return IslandRequest(args.islands, args.outer_max_comm_share, fields, args.outer_max_interval)


def manual_islands(
    args: argparse.Namespace, num_pipelines: int, num_layers: int
) -> tuple[tuple[tuple[int, ...], ...], OuterSettings | None]:
    """(islands, outer settings) of `manual` from --islands FILE and the --outer-* flags."""
    fields = outer_fields(args)
    if args.islands is None:
        if fields and "interval" not in fields:
            flag = _OUTER_FLAGS[next(iter(fields))]
            raise SpecError(f"{flag}: needs --outer-interval (the inner steps between outer steps)")
        return (), outer_settings(fields, num_layers) if fields else None
    raw = read_json(args.islands, "islands file")
    if not isinstance(raw, list) or not all(isinstance(x, list) for x in raw):
        raise SpecError(
            f"--islands: {args.islands} must hold a JSON list of pipeline-index lists, "
            f"e.g. [[0, 1], [2]]"
        )
    problems = islands_problems([{"pipelines": x} for x in raw], num_pipelines)
    if problems:
        raise SpecError([f"--islands: {p}" for p in problems])
    if "interval" not in fields and len(raw) > 1:
        raise SpecError(
            "--islands: islands meet only at outer steps; give --outer-interval (the inner "
            "steps between them)"
        )
    outer = outer_settings(fields, num_layers) if "interval" in fields else None
    return tuple(tuple(x) for x in raw), outer


def describe_islands(plan: Plan) -> list[str]:
    """Lines for `show`: each island's pipelines and sites, and the outer settings (none for a
    plan of one island without outer steps)."""
    lines = []
    if plan.islands:
        nodes = {n.name: n for n in plan.cluster.nodes}
        parts = []
        for i, pipes in enumerate(plan.islands):
            sites = sorted(
                {
                    str(nodes[plan.ranks[r].node].site)
                    for p in pipes
                    for r in plan.pipelines[p].ranks
                }
            )
            samples = sum(plan.pipelines[p].num_samples for p in pipes)
            parts.append(
                f"{i}: pipelines {list(pipes)}, {samples} samples"
                + ("" if sites == ["None"] else f", site {'+'.join(sites)}")
            )
        lines.append(f"islands: {len(plan.islands)} ({'; '.join(parts)})")
    o = plan.training.outer
    if o is not None:
        lines.append(
            f"outer step: every {o.interval} steps, {o.optimizer} lr {o.lr:g} momentum "
            f"{o.momentum:g}, compression {o.compression}, {o.fragments} fragment(s)"
        )
    return lines


def describe_outer_estimate(est: Mapping[str, Any]) -> str:
    """The estimate's island figures in one line ('' without them)."""
    if est.get("inner_step_time_s") is None:
        return ""
    return (
        f"inner step {est['inner_step_time_s']:.4g} s + outer sync "
        f"{est['outer_sync_time_s']:.4g} s per step (amortised); "
        f"{est['cross_site_bytes_per_step'] / 1e6:.4g} MB across sites per step"
    )
