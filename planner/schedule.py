"""1F1B pipeline schedule time, by simulating its events (no closed formula).

Stage k of p runs min(p-k-1, m) warm-up forwards, then alternates one forward and one backward,
then drains the remaining backwards (megatron-core's non-interleaved 1F1B). An operation starts
when its stage is free and its input has arrived: the forward of micro-batch j on stage k needs
forward j of stage k-1 plus the boundary transfer; the backward needs backward j of stage k+1 plus
the transfer back (the last stage's backward follows its own forward). Every stage has its own
forward/backward time, so warm-up, steady state and cool-down come out of the simulation.

For many micro-batches the schedule becomes periodic (a max-plus linear system), so beyond
SIMULATED_MICROBATCHES_PER_STAGE x p micro-batches the time is extrapolated linearly with the
exact periodic rate (`steady_period`); tests check it against the full simulation.
"""

from collections.abc import Sequence
from typing import Any, cast

import numpy as np

# Micro-batches simulated per stage before extrapolating (beyond the transient; tests check it).
SIMULATED_MICROBATCHES_PER_STAGE = 4
SIMULATED_MICROBATCHES_MIN = 24


_ORDERS: dict[tuple[int, int], tuple[tuple[bool, int], ...]] = {}
# pipeline_time memo: identical pipelines (same stage times) simulated once; also linear_fit's
_TIMES: dict[tuple[Any, ...], Any] = {}
_MEMO_MAX = 200_000


def _order(k: int, p: int, m: int) -> tuple[tuple[bool, int], ...]:
    """Operation sequence of stage k: tuple of (is_forward, micro-batch)."""
    key = (min(p - k - 1, m), m)
    got = _ORDERS.get(key)
    if got is None:
        warm = key[0]
        ops = [(True, j) for j in range(warm)]
        for j in range(m - warm):
            ops.append((True, warm + j))
            ops.append((False, j))
        ops.extend((False, j) for j in range(m - warm, m))
        if len(_ORDERS) > _MEMO_MAX:
            _ORDERS.clear()
        got = _ORDERS[key] = tuple(ops)
    return got


def simulate_1f1b(
    fwd: Sequence[float],
    bwd: Sequence[float],
    xfer_f: Sequence[float],
    xfer_b: Sequence[float],
    m: int,
) -> float:
    """Exact event simulation; returns the time the last operation ends.

    fwd[k], bwd[k]: seconds per micro-batch on stage k (incl. its TP and all-gather time);
    xfer_f[k], xfer_b[k]: transfer seconds across boundary k (between stage k and k+1).

    Runs the operations in one precomputed dependency order per (p, m) (`_plan`): each end time
    is max(dependency end + transfer, previous operation on the stage) + duration, the same
    max-plus recurrence as `simulate_1f1b_sweep`, bit for bit, without its readiness checks.
    """
    if m <= 0 or not fwd:
        return 0.0
    return max(_end_times(fwd, bwd, xfer_f, xfer_b, m))


def _end_times(
    fwd: Sequence[float],
    bwd: Sequence[float],
    xfer_f: Sequence[float],
    xfer_b: Sequence[float],
    m: int,
) -> list[float]:
    """End of every operation (index as in `_plan`; one extra slot, 0.0, at the end)."""
    p = len(fwd)
    plan = _plan(p, m)
    durs = list(fwd) + list(bwd)
    xs = [0.0] + list(xfer_f) + list(xfer_b)
    end = [0.0] * (2 * p * m + 1)  # the last slot stays 0.0: "no dependency"
    for o, dep, xi, prev, di in plan:
        a = end[dep] + xs[xi]
        b = end[prev]
        end[o] = (a if a > b else b) + durs[di]
    return end


def last_backward_ends(
    fwd: Sequence[float],
    bwd: Sequence[float],
    xfer_f: Sequence[float],
    xfer_b: Sequence[float],
    m: int,
) -> tuple[float, ...]:
    """Per stage, when its last backward (micro-batch m - 1) ends: when the stage's gradients
    are complete. The last stage finishes first and stage 0 last, at `pipeline_time`.

    Up to the simulated count (`pipeline_time`'s cap) this is the event simulation's own end
    times. Beyond it, each stage keeps its distance to stage 0's end from the simulation at
    the cap (the cool-down after the periodic regime does not depend on m), and stage 0 ends
    at the extrapolated `pipeline_time`.
    """
    p = len(fwd)
    if m <= 0 or p == 0:
        return (0.0,) * p
    cap = max(SIMULATED_MICROBATCHES_MIN, SIMULATED_MICROBATCHES_PER_STAGE * p)
    n = min(m, cap)
    key = (tuple(fwd), tuple(bwd), tuple(xfer_f), tuple(xfer_b), n, "ends")
    last = _TIMES.get(key)
    if last is None:
        end = _end_times(fwd, bwd, xfer_f, xfer_b, n)
        last = tuple(end[p * n + k * n + n - 1] for k in range(p))
        if len(_TIMES) > _MEMO_MAX:
            _TIMES.clear()
        _TIMES[key] = last
    if m <= cap:
        return cast(tuple[float, ...], last)
    total = pipeline_time(fwd, bwd, xfer_f, xfer_b, m)
    return tuple(total - (last[0] - e) for e in last)


# One operation of `_plan`: (op, dependency, transfer index, previous op, duration index).
_Op = tuple[int, int, int, int, int]
_PLANS: dict[tuple[int, int], tuple[_Op, ...]] = {}


def _plan(p: int, m: int) -> tuple[_Op, ...]:
    """(op, dependency, transfer index, previous op on the stage, duration index) for every
    operation, in an order where dependencies come first: the start order of the same schedule
    with unit durations and no transfers (a dependency ends no later than its dependant starts,
    and every op takes one unit, so dependencies start strictly earlier)."""
    key = (p, m)
    got = _PLANS.get(key)
    if got is not None:
        return got
    none = 2 * p * m
    starts = _start_times(p, m)
    ops = []
    for k in range(p):
        prev = none
        for is_f, j in _order(k, p, m):
            if is_f:
                o = k * m + j
                dep, xi = ((k - 1) * m + j, k) if k else (none, 0)
                di = k
            else:
                o = p * m + k * m + j
                if k == p - 1:
                    dep, xi = (k * m + j, 0)
                else:
                    dep, xi = (p * m + (k + 1) * m + j, p + k)
                di = p + k
            ops.append((starts[o], k, o, dep, xi, prev, di))
            prev = o
    ops.sort()
    if len(_PLANS) > 256:
        _PLANS.clear()
    got = _PLANS[key] = tuple(x[2:] for x in ops)
    return got


def _start_times(p: int, m: int) -> dict[int, float]:
    """Start of every op (index as in `_plan`) with unit durations and no transfers."""
    starts: dict[int, float] = {}
    _simulate_sweep([1.0] * p, [1.0] * p, [0.0] * (p - 1), [0.0] * (p - 1), m, starts)
    return starts


def simulate_1f1b_sweep(
    fwd: Sequence[float],
    bwd: Sequence[float],
    xfer_f: Sequence[float],
    xfer_b: Sequence[float],
    m: int,
) -> float:
    """Reference event simulation by readiness sweeps (the definition `simulate_1f1b` follows)."""
    return _simulate_sweep(fwd, bwd, xfer_f, xfer_b, m)


def _simulate_sweep(
    fwd: Sequence[float],
    bwd: Sequence[float],
    xfer_f: Sequence[float],
    xfer_b: Sequence[float],
    m: int,
    starts: dict[int, float] | None = None,
) -> float:
    """Exact event simulation; returns the time the last backward of stage 0 ends.

    fwd[k], bwd[k]: seconds per micro-batch on stage k (incl. its TP and all-gather time);
    xfer_f[k], xfer_b[k]: transfer seconds across boundary k (between stage k and k+1).
    """
    p = len(fwd)
    orders = [_order(k, p, m) for k in range(p)]
    f_end: list[list[float | None]] = [[None] * m for _ in range(p)]
    b_end: list[list[float | None]] = [[None] * m for _ in range(p)]
    pos = [0] * p
    free = [0.0] * p
    remaining = sum(len(o) for o in orders)
    down, up = list(range(p)), list(range(p - 1, -1, -1))
    sweep = 0
    while remaining:
        progressed = False
        sweep += 1
        for k in down if sweep % 2 else up:  # forwards flow down, backwards flow up
            ops, i = orders[k], pos[k]
            fe, be = f_end[k], b_end[k]
            while i < len(ops):
                is_f, j = ops[i]
                if is_f:
                    if k == 0:
                        ready = 0.0
                    else:
                        prev = f_end[k - 1][j]
                        if prev is None:
                            break
                        ready = prev + xfer_f[k - 1]
                    start = free[k] if free[k] > ready else ready
                    free[k] = fe[j] = start + fwd[k]
                    if starts is not None:
                        starts[k * m + j] = start
                else:
                    if k == p - 1:
                        ready = cast(float, fe[j])  # its own forward j ran before
                    else:
                        nxt = b_end[k + 1][j]
                        if nxt is None:
                            break
                        ready = nxt + xfer_b[k]
                    start = free[k] if free[k] > ready else ready
                    free[k] = be[j] = start + bwd[k]
                    if starts is not None:
                        starts[p * m + k * m + j] = start
                i += 1
                remaining -= 1
                progressed = True
            pos[k] = i
        if not progressed:
            raise RuntimeError("1F1B simulation deadlocked (schedule bug)")
    return max(free)


def pipeline_time(
    fwd: Sequence[float],
    bwd: Sequence[float],
    xfer_f: Sequence[float],
    xfer_b: Sequence[float],
    m: int,
) -> float:
    """1F1B time of m micro-batches: simulated, extrapolated beyond the periodic regime."""
    key = (tuple(fwd), tuple(bwd), tuple(xfer_f), tuple(xfer_b), m)
    got = _TIMES.get(key)
    if got is not None:
        return got
    p = len(fwd)
    cap = max(SIMULATED_MICROBATCHES_MIN, SIMULATED_MICROBATCHES_PER_STAGE * p)
    if m <= cap:
        got = simulate_1f1b(fwd, bwd, xfer_f, xfer_b, m)
    else:
        a, rate = linear_fit(fwd, bwd, xfer_f, xfer_b)
        got = a + m * rate
    if len(_TIMES) > _MEMO_MAX:
        _TIMES.clear()
    _TIMES[key] = got
    return got


def steady_period(
    fwd: Sequence[float], bwd: Sequence[float], xfer_f: Sequence[float], xfer_b: Sequence[float]
) -> float:
    """Seconds per micro-batch of the periodic 1F1B regime: the largest mean over windows of
    consecutive stages a..z of (their forward + backward times + the transfers both ways across
    the boundaries inside the window) / (z - a + 1).

    Each window is a cycle of the schedule's dependency graph: B(z, j) -> ... -> B(a, j) ->
    F(a, j + warm-up(a) + 1) -> ... -> F(z, j + warm-up(a) + 1) -> B(z, j + z - a + 1), so it
    spans z - a + 1 micro-batches; the largest cycle mean is the growth rate of the max-plus
    system. A slow link between two stages therefore slows the steady state, not only the
    pipeline fill.
    """
    return window_period([f + b for f, b in zip(fwd, bwd)], [f + b for f, b in zip(xfer_f, xfer_b)])


# (lower, upper, window length) index arrays of every window of p stages, by p
_WINDOWS: dict[int, tuple[Any, Any, Any]] = {}


def window_period(w: Sequence[float], x: Sequence[float]) -> float:
    """`steady_period` from each stage's forward + backward time `w` and each boundary's
    transfers both ways `x` (the search keeps these sums; the same value, bit for bit)."""
    p = len(w)
    if p > 16:  # O(p^2) windows at once
        got = _WINDOWS.get(p)
        if got is None:
            lo, hi = np.triu_indices(p)  # every window lo..hi
            got = _WINDOWS[p] = (lo, hi, hi - lo + 1)
        lo, hi, n = got
        s = np.concatenate(([0.0], np.cumsum(np.asarray(w, float))))
        c = np.concatenate(([0.0], np.cumsum(np.asarray(x, float))))  # boundaries a..z-1
        return float(((s[hi + 1] - s[lo] + c[hi] - c[lo]) / n).max())
    best = 0.0
    for a in range(p):
        acc = w[a]
        if acc > best:
            best = acc
        for z in range(a + 1, p):
            acc += w[z]
            acc += x[z - 1]
            mean = acc / (z - a + 1)
            if mean > best:
                best = mean
    return best


def linear_fit(
    fwd: Sequence[float], bwd: Sequence[float], xfer_f: Sequence[float], xfer_b: Sequence[float]
) -> tuple[float, float]:
    """(fixed, per_microbatch) with time(m) ~ fixed + m * per_microbatch for large m.

    per_microbatch is the exact periodic rate (`steady_period`); fixed comes from simulating
    max(SIMULATED_MICROBATCHES_MIN, SIMULATED_MICROBATCHES_PER_STAGE x p) micro-batches. (A
    two-point difference of simulations instead can be off by 10 % when slow links lengthen the
    transient.) Used for m beyond that count and by the batch allocation.
    """
    key = (tuple(fwd), tuple(bwd), tuple(xfer_f), tuple(xfer_b), "fit")
    got = _TIMES.get(key)
    if got is not None:
        return got
    p = len(fwd)
    cap = max(SIMULATED_MICROBATCHES_MIN, SIMULATED_MICROBATCHES_PER_STAGE * p)
    rate = steady_period(fwd, bwd, xfer_f, xfer_b)
    got = _TIMES[key] = (simulate_1f1b(fwd, bwd, xfer_f, xfer_b, cap) - cap * rate, rate)
    return got
