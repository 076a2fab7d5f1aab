"""A fixed pure-Python workload whose CPU seconds measure how fast this machine runs Python now.

The planner's CPU-second targets are absolute, but the machine they are measured on is not: the
same search on the same commit took 1.6-1.8x longer on some days than on others, and 20 % longer
within one afternoon (docs/benchmarks.md, "Search quality and planner scaling"). A benchmark
that times this workload beside its own measurement shows the machine's speed of that moment, so
a reader can tell a slower commit from a slower machine: `cpu / yardstick` moves far less than
CPU seconds (5 % against 40 % over five equal searches), though not to nothing.

The work is of the search's kind and touches no project code, so no change to the project moves
it: float sums and maxima over lists, dict lookups keyed by tuples, a heap, sorting.
"""

import gc
import heapq
import time

ROUNDS = 300  # about 0.3 CPU s a run on the 2-core development machine


def _work() -> float:
    acc = 0.0
    memo: dict[tuple[int, int], float] = {}
    for r in range(ROUNDS):
        w = [((i * 7919 + r * 104729) % 1009) / 1009.0 + 0.5 for i in range(400)]
        # windows of consecutive stages (the shape of schedule.window_period)
        best = 0.0
        for a in range(0, 400, 8):
            s = 0.0
            for z in range(a, min(a + 48, 400)):
                s += w[z]
                m = s / (z - a + 1)
                if m > best:
                    best = m
        # a heap sweep (the shape of assign_layers)
        heap = [(x, i) for i, x in enumerate(w[:200])]
        heapq.heapify(heap)
        for _ in range(150):
            x, i = heapq.heappop(heap)
            heapq.heappush(heap, (x + w[i], i))
        # memoised lookups and a sort
        for i in range(2000):
            key = (i % 97, r % 5)
            got = memo.get(key)
            if got is None:
                got = memo[key] = w[i % 400] * 2.0
            acc += got
        acc += best + sorted(w, reverse=True)[3] + heap[0][0]
    return acc


def yardstick_cpu_s(repeats: int = 3) -> float:
    """CPU seconds of the workload: the mean of `repeats` runs (a spell of the machine slows
    all of a benchmark, so the mean, not the fastest, is its measure). The garbage collector is
    off meanwhile: after a large search its sweeps of the search's objects would count here."""
    times = []
    enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeats):
            t = time.process_time()
            _work()
            times.append(time.process_time() - t)
    finally:
        if enabled:
            gc.enable()
    return sum(times) / len(times)


if __name__ == "__main__":
    print(f"yardstick {yardstick_cpu_s():.3f} CPU s")
