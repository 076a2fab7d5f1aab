"""Integer splits: how a count is cut into parts, evenly, by weight, or by weight with every part
non-empty. The plan cuts a stage's layers and batches with them, the layout its shards, the
distributed optimizer its segments. Pure arithmetic, no planner imports beyond the error type."""

from __future__ import annotations

from collections.abc import Sequence

from planner.errors import SpecError


def even_split(total: int, parts: int) -> list[int]:
    """Split `total` into `parts` positive sizes differing by at most one, larger ones first."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def weighted_split(length: int, weights: Sequence[float]) -> list[int]:
    """Cut `length` into len(weights) parts (zero allowed) in proportion to `weights`.

    Largest remainders, ties to the lower index; equal weights give `even_split`. This is how
    the distributed optimizer cuts a segment among its holders.
    """
    if all(w == weights[0] for w in weights):
        return even_split(length, len(weights))
    total = sum(weights)
    raw = [length * w / total for w in weights]
    parts = [int(x) for x in raw]
    order = sorted(range(len(raw)), key=lambda i: raw[i] - parts[i], reverse=True)
    for i in order[: length - sum(parts)]:
        parts[i] += 1
    return parts


def proportional_split(total: int, weights: Sequence[float]) -> list[int]:
    """Integers >= 1 summing to `total`, proportional to `weights`: one each, and the rest by
    `weighted_split` (same largest remainders).

    Uneven TP shards: whole query groups, FFN columns and vocabulary rows per rank in proportion
    to each rank's speed, where every rank must hold some. Equal weights give `even_split`.
    """
    n = len(weights)
    if total < n:
        raise SpecError(f"cannot split {total} into {n} non-empty shards")
    return [1 + x for x in weighted_split(total - n, weights)]
