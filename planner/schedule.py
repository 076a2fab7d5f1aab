"""1F1B pipeline schedule time, by simulating its events (no closed formula).

Stage k of p runs min(p-k-1, m) warm-up forwards, then alternates one forward and one backward,
then drains the remaining backwards (megatron-core's non-interleaved 1F1B). An operation starts
when its stage is free and its input has arrived: the forward of micro-batch j on stage k needs
forward j of stage k-1 plus the boundary transfer; the backward needs backward j of stage k+1 plus
the transfer back (the last stage's backward follows its own forward). Every stage has its own
forward/backward time, so warm-up, steady state and cool-down come out of the simulation.

For many micro-batches the schedule becomes periodic (a max-plus linear system), so beyond
SIMULATED_MICROBATCHES_PER_STAGE x p micro-batches the time is extrapolated linearly from the
last simulated period; tests check it against the full simulation.
"""

# Micro-batches simulated per stage before extrapolating (beyond the transient; tests check it).
SIMULATED_MICROBATCHES_PER_STAGE = 4
SIMULATED_MICROBATCHES_MIN = 24


def _order(k, p, m):
    """Operation sequence of stage k: list of (is_forward, micro-batch)."""
    warm = min(p - k - 1, m)
    ops = [(True, j) for j in range(warm)]
    for j in range(m - warm):
        ops.append((True, warm + j))
        ops.append((False, j))
    ops.extend((False, j) for j in range(m - warm, m))
    return ops


def simulate_1f1b(fwd, bwd, xfer_f, xfer_b, m):
    """Exact event simulation; returns the time the last backward of stage 0 ends.

    fwd[k], bwd[k]: seconds per micro-batch on stage k (incl. its TP and all-gather time);
    xfer_f[k], xfer_b[k]: transfer seconds across boundary k (between stage k and k+1).
    """
    p = len(fwd)
    orders = [_order(k, p, m) for k in range(p)]
    f_end = [[None] * m for _ in range(p)]
    b_end = [[None] * m for _ in range(p)]
    pos = [0] * p
    free = [0.0] * p
    remaining = sum(len(o) for o in orders)
    down, up = list(range(p)), list(range(p - 1, -1, -1))
    sweep = 0
    while remaining:
        progressed = False
        sweep += 1
        for k in (down if sweep % 2 else up):     # forwards flow down, backwards flow up
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
                else:
                    if k == p - 1:
                        ready = fe[j]
                    else:
                        nxt = b_end[k + 1][j]
                        if nxt is None:
                            break
                        ready = nxt + xfer_b[k]
                    start = free[k] if free[k] > ready else ready
                    free[k] = be[j] = start + bwd[k]
                i += 1
                remaining -= 1
                progressed = True
            pos[k] = i
        if not progressed:
            raise RuntimeError("1F1B simulation deadlocked (schedule bug)")
    return max(free)


def pipeline_time(fwd, bwd, xfer_f, xfer_b, m):
    """1F1B time of m micro-batches: simulated, extrapolated beyond the periodic regime."""
    p = len(fwd)
    cap = max(SIMULATED_MICROBATCHES_MIN, SIMULATED_MICROBATCHES_PER_STAGE * p)
    if m <= cap:
        return simulate_1f1b(fwd, bwd, xfer_f, xfer_b, m)
    t1 = simulate_1f1b(fwd, bwd, xfer_f, xfer_b, cap - p)
    t2 = simulate_1f1b(fwd, bwd, xfer_f, xfer_b, cap)
    return t2 + (m - cap) * (t2 - t1) / p


def linear_fit(fwd, bwd, xfer_f, xfer_b):
    """(fixed, per_microbatch) with time(m) ~ fixed + m * per_microbatch for large m.

    Used by the batch allocation to balance pipelines before the exact schedule is simulated.
    """
    p = len(fwd)
    cap = max(SIMULATED_MICROBATCHES_MIN, SIMULATED_MICROBATCHES_PER_STAGE * p)
    t1 = simulate_1f1b(fwd, bwd, xfer_f, xfer_b, cap - p)
    t2 = simulate_1f1b(fwd, bwd, xfer_f, xfer_b, cap)
    rate = (t2 - t1) / p
    return t2 - cap * rate, rate
