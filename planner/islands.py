"""Islands: groups of pipelines that synchronise every step inside and meet only at outer steps.

Sites joined by slow links train as islands (DiLoCo). Inside an island the weighted gradient sync
of every plan runs at every step, so the island's pipelines hold the same parameters. Across
islands, after every `interval` (H) inner steps, each island's parameter change since the last
outer step is averaged over the islands, weighted by the tokens each island processed, and an
outer optimizer applies it. A plan without `islands` is one island; a plan without
`training.outer` never takes an outer step, so every plan written before islands keeps its
meaning.

This module owns the rules and the arithmetic the planner and the runtime share:
- the plan fields (`islands`, `training.outer`) and their validation;
- the outer step's schedule: which layers form fragment f and after which inner steps it syncs;
- the outer update itself (`outer_update`), written once for the runtime and the reference;
- the bytes one rank sends across islands for a buffer of n elements (`outer_bytes_sent`), so
  the runtime's metric and the planner's prediction are one formula (summed per range by
  planner.outer_traffic).

Semantics, which the runtime and the tests' one-process reference follow exactly:
- Outer gradient of island k: Delta_k = theta_outer - theta_k (the parameters at the last outer
  step minus the island's parameters now; fp32, from the optimizer's main parameters).
- Averaged: Delta = sum_k (tokens_k / tokens) * Delta_k, tokens_k the island's samples per step
  (every step processes the same samples, so per-step counts weigh the same as totals).
- `sgd`: buf = momentum * buf + Delta; theta_outer -= lr * buf.
  `nesterov`: buf = momentum * buf + Delta; theta_outer -= lr * (Delta + momentum * buf)
  (torch.optim.SGD's rules, dampening 0). Every island then continues from theta_outer; the inner
  optimizers keep their state. H = 1, `sgd`, lr 1, momentum 0 is synchronous training.
- Compression: `none` sums fp32; `bf16` and `int8` round each island's Delta_k (int8: blocks of
  INT8_BLOCK elements, each with an fp32 scale max|x| / 127, round half to even) and sum the
  dequantised values in fp32, in island order.
- Fragments (Streaming DiLoCo): with F > 1 the layers are cut into F contiguous fragments
  (`fragment_layers`; the embedding goes with fragment 0, the final norm and output layer with
  fragment F - 1). Fragment f syncs after inner step s (1-based) when s % H == fragment_offset(f).
  Its exchange runs during the next inner step's forward and backward; its result lands before
  that step's optimizer update, which then applies to the landed parameters. With F = 1 the outer
  step runs right after the H-th inner step's optimizer update and blocks.
- Who sends: the pipelines of one island hold equal parameters, so for each canonical range one
  rank per island exchanges it across islands (its representative) and the result reaches the
  range's other holders in the island over the island's own links. planner.outer_traffic is the
  one statement of the ranges, their representatives and the bytes each rank sends; the runtime,
  its byte metric and the simulator all read it. Without the distributed optimizer the
  representative is the holder in the island's lowest-numbered pipeline (its lowest rank there),
  which hands the result on; with it, the ranges are cut further where the island's fp32 master
  parts end, the representative is the owner of the range's master part, and the optimizer's
  parameter all-gather hands the result on.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from planner.inputs import int_problem, is_int, is_number, short
from planner.splits import even_split

OUTER_OPTIMIZERS = ("sgd", "nesterov")
OUTER_COMPRESSIONS = ("none", "bf16", "int8")
# Elements per int8 block, each with one fp32 scale; INTELLECT-1 and Streaming DiLoCo quantise
# per block or per tensor; 256 keeps the scale overhead at 1.6 % of the int8 payload.
INT8_BLOCK = 256
MAX_OUTER_INTERVAL = 1_000_000
_OUTER_KEYS = {"interval", "optimizer", "lr", "momentum", "compression", "fragments"}


@dataclass(frozen=True)
class OuterSettings:
    """`training.outer`: how islands meet. Defaults are DiLoCo's (Douillard et al., 2023)."""

    interval: int
    optimizer: str = "nesterov"
    lr: float = 0.7
    momentum: float = 0.9
    compression: str = "none"
    fragments: int = 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "interval": self.interval,
            "optimizer": self.optimizer,
            "lr": self.lr,
            "momentum": self.momentum,
            "compression": self.compression,
            "fragments": self.fragments,
        }


def outer_from_dict(data: Mapping[str, Any]) -> OuterSettings:
    """Build from a validated `training.outer` object; absent fields take the defaults."""
    d = OuterSettings(interval=data["interval"])
    return OuterSettings(
        interval=data["interval"],
        optimizer=data.get("optimizer", d.optimizer),
        lr=float(data.get("lr", d.lr)),
        momentum=float(data.get("momentum", d.momentum)),
        compression=data.get("compression", d.compression),
        fragments=data.get("fragments", d.fragments),
    )


def outer_problems(outer: object, num_layers: int | None) -> list[str]:
    """One line per problem of `training.outer` (num_layers None: the model is unknown)."""
    where = "training.outer"
    if not isinstance(outer, dict):
        return [f"{where}: must be an object with interval (and optimizer, lr, momentum, ...)"]
    problems = [f"{where}.{k}: unknown field" for k in sorted(set(outer) - _OUTER_KEYS)]
    if "interval" not in outer:
        problems.append(f"{where}.interval: missing (the inner steps between outer steps, H)")
    else:
        bad = int_problem(outer["interval"], f"{where}.interval", 1, MAX_OUTER_INTERVAL)
        if bad:
            problems.append(bad)
    opt = outer.get("optimizer", "nesterov")
    if opt not in OUTER_OPTIMIZERS:
        problems.append(
            f"{where}.optimizer: must be one of {', '.join(OUTER_OPTIMIZERS)}, got {short(opt)}"
        )
    lr = outer.get("lr", 0.7)
    if not is_number(lr) or not 0 < lr <= 100:
        problems.append(f"{where}.lr: must be a number in (0, 100], got {short(lr)}")
    momentum = outer.get("momentum", 0.9)
    if not is_number(momentum) or not 0 <= momentum < 1:
        problems.append(f"{where}.momentum: must be a number in [0, 1), got {short(momentum)}")
    comp = outer.get("compression", "none")
    if comp not in OUTER_COMPRESSIONS:
        problems.append(
            f"{where}.compression: must be one of {', '.join(OUTER_COMPRESSIONS)}, "
            f"got {short(comp)}"
        )
    frags = outer.get("fragments", 1)
    bad = int_problem(frags, f"{where}.fragments", 1, MAX_OUTER_INTERVAL)
    if bad:
        problems.append(bad)
    elif num_layers is not None and frags > num_layers:
        problems.append(
            f"{where}.fragments: {frags} fragments, but the model has only {num_layers} layers "
            f"(a fragment is at least one layer)"
        )
    return problems


def islands_problems(islands: object, num_pipelines: int) -> list[str]:
    """One line per problem of the plan's `islands` (every pipeline in exactly one island)."""
    if not isinstance(islands, list) or not islands:
        return ['islands: must be a non-empty list of {"pipelines": [...]}']
    problems: list[str] = []
    owner: dict[int, int] = {}
    for i, island in enumerate(islands):
        where = f"islands[{i}]"
        if not isinstance(island, dict) or "pipelines" not in island:
            problems.append(f'{where}: must be an object {{"pipelines": [pipeline indices]}}')
            continue
        problems.extend(f"{where}.{k}: unknown field" for k in sorted(set(island) - {"pipelines"}))
        pipes = island["pipelines"]
        if not isinstance(pipes, list) or not pipes:
            problems.append(f"{where}.pipelines: an island needs at least one pipeline")
            continue
        for p in pipes:
            if not is_int(p) or not 0 <= p < num_pipelines:
                problems.append(
                    f"{where}.pipelines: {short(p)} is not a pipeline index "
                    f"(the plan has {num_pipelines} pipelines)"
                )
            elif p in owner:
                problems.append(
                    f"{where}.pipelines: pipeline {p} is also in islands[{owner[p]}] "
                    f"(a pipeline is in exactly one island)"
                )
            else:
                owner[p] = i
    if not problems:
        missing = [p for p in range(num_pipelines) if p not in owner]
        if missing:
            problems.append(
                f"islands: pipelines {', '.join(map(str, missing))} are in no island "
                f"(every pipeline is in exactly one island)"
            )
    return problems


def island_of_pipeline(islands: Sequence[Sequence[int]], num_pipelines: int) -> list[int]:
    """Island index of every pipeline; no islands means one island holding all."""
    if not islands:
        return [0] * num_pipelines
    owner = [0] * num_pipelines
    for i, pipes in enumerate(islands):
        for p in pipes:
            owner[p] = i
    return owner


def fragment_layers(num_layers: int, fragments: int) -> list[tuple[int, int]]:
    """[first, last) layers of each fragment: contiguous, sizes as even as integers allow."""
    sizes = even_split(num_layers, fragments)
    out, first = [], 0
    for n in sizes:
        out.append((first, first + n))
        first += n
    return out


def fragment_offset(fragment: int, fragments: int, interval: int) -> int:
    """Fragment f syncs after inner steps s with s % interval == this (staggered evenly)."""
    return (fragment * interval) // fragments


def syncs_after_step(step: int, fragment: int, outer: OuterSettings) -> bool:
    """Whether `fragment` starts an outer exchange after inner step `step` (1-based)."""
    return step % outer.interval == fragment_offset(fragment, outer.fragments, outer.interval)


def outer_update(
    theta_outer: float, delta: float, buf: float, outer: OuterSettings
) -> tuple[float, float]:
    """(new theta_outer, new momentum buffer) for one element; the tensor code follows this."""
    buf = outer.momentum * buf + delta
    step = delta + outer.momentum * buf if outer.optimizer == "nesterov" else buf
    return theta_outer - outer.lr * step, buf


def payload_bytes(elements: int, compression: str) -> int:
    """Bytes of one island's outer gradient for a buffer of `elements` values, as sent."""
    if compression == "none":
        return 4 * elements
    if compression == "bf16":
        return 2 * elements
    return elements + 4 * math.ceil(elements / INT8_BLOCK)


def outer_bytes_sent(elements: int, islands: int, compression: str) -> int:
    """Bytes one island's representative rank sends across islands for one buffer.

    `none` is a ring all-reduce of fp32 values (2 (k - 1) / k of the buffer, rounded down);
    `bf16` and `int8` all-gather every island's compressed buffer ((k - 1) sends of it), since
    the sum is taken in fp32 after decompression.
    """
    if islands <= 1:
        return 0
    if compression == "none":
        return (2 * (islands - 1) * payload_bytes(elements, compression)) // islands
    return (islands - 1) * payload_bytes(elements, compression)
