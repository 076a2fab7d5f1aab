"""Collective curves on the local group: a small torch.distributed job of `procs` processes.

Each process sets the profile's thread count, joins a gloo (CPU) or NCCL (CUDA) group, times
all-reduce, all-gather (into a list, as the runtime's boundary gather does) and p2p send/recv
(half a ping-pong) for growing sizes, then (optionally) times one reference layer with all
processes computing at once (that ratio is the contention the planner applies when a node runs
that many processes), and times TP layers over the real group (see _layer_runs). Rank 0 writes
the results to a JSON file.

hexi-profile starts the job before its compute grid (`CommJob`): the processes start, train one
data-parallel burst, then sleep (no collective is polling) while the parent measures alone. The
parent asks for more bursts between its grid rounds, each next to one of its one-rank bursts, and
the job trains two more at the end: contention is sampled over the whole profile, as the runs it
predicts are sampled over time. The start-up cost is paid while the parent would wait anyway.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from megatron_hexi.profile.records import (
        BurstDone,
        CommRecord,
        CommResult,
        CurvePoint,
        LayerRuns,
        TPLayerRow,
        TrainingStep,
    )
    from planner.models import ModelSpec


# Rounds of the in-situ TP runs: the TP layer's comm on gloo is the noisiest figure of a CPU
# profile (the fastest of 3 rounds moved 22.0 -> 25.6 ms per layer pass between two profiles of
# the fidelity model, its compute 16.8 -> 17.5 ms); the fastest of more rounds moves less. On
# 120 rounds of the fidelity model's TP2 layer (micro-batch 2) the comm beyond the shard's
# compute, fastest round less fastest round, came out 4.4 +- 0.7 ms per layer pass over 6
# rounds, 3.9 +- 0.5 over 12, 3.9 +- 0.4 over 15 and 3.9 +- 0.3 over 30: past 12 rounds the
# figure stops falling and only its spread narrows.
TP_ROUNDS = 15


class LayerJob(NamedTuple):
    """What the job's processes time besides collectives (_layer_runs)."""

    model: ModelSpec
    micro_batch_sizes: Sequence[int]
    reps: int
    dtype_name: str
    contention: int  # TP width of the contention reference, 0 for none (then no bursts)
    attention_backend: str  # the profile's (measure.py)


def _time(fn: Callable[[], object], reps: int, device: torch.device) -> float:
    out = []
    for i in range(reps + 2):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 2:
            out.append(time.perf_counter() - t0)
    # the slowest rank's median is what a collective costs the group
    t = torch.tensor([statistics.median(out)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def fit_ring(
    points: Sequence[CurvePoint], lat_coef: float, byte_coef: float
) -> dict[str, float] | None:
    """(bandwidth, latency) of the ring model t = lat_coef*lat + byte_coef*bytes/bw: latency from
    the smallest message, bandwidth from the largest (where bytes dominate)."""
    if len(points) < 2:
        return None
    pts = sorted(points, key=lambda p: p["bytes"])
    lat = min(p["s"] for p in pts[:2]) / lat_coef
    big = pts[-1]
    rest = max(big["s"] - lat_coef * lat, 1e-12)
    return {"bandwidth_gbs": byte_coef * big["bytes"] / rest / 1e9, "latency_us": lat * 1e6}


def _pingpong(rank: int, x: torch.Tensor) -> None:
    """One round trip of `x` between ranks 0 and 1; the other ranks do nothing."""
    if rank == 0:
        dist.send(x, 1)
        dist.recv(x, 1)
    elif rank == 1:
        dist.recv(x, 0)
        dist.send(x, 0)


def _worker(
    rank: int,
    procs: int,
    port: int,
    files: Mapping[str, str],
    sizes: Sequence[int],
    reps: int,
    threads: int,
    device_type: str,
    wait_s: float,
    layer_job: LayerJob | None,
) -> NoReturn:
    parent = os.getppid()
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(procs),
        }
    )
    torch.set_num_threads(threads)
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        from megatron_hexi.patches import apply_cpu_patches

        apply_cpu_patches()
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=procs
    )
    singles = [dist.new_group([r]) for r in range(procs)]
    bursts: list[TrainingStep] = []  # data-parallel Trainer steps, on the parent's requests

    def burst(n: int) -> None:
        if layer_job is not None and layer_job.contention:
            from megatron_hexi.profile.runtime_overhead import data_parallel_step

            job = layer_job
            bursts.append(
                data_parallel_step(job.model, device, job.reps, procs, job.attention_backend)
            )
        dist.barrier()
        if rank == 0:
            _write(files["done"].format(n), {"step_s": bursts[-1]["step_s"] if bursts else None})

    burst(0)
    n = 0
    while True:  # sleep until the parent asks for a burst or the measurements
        n += 1
        cmd = _wait_for(files["cmd"].format(n), wait_s, lambda: os.getppid() == parent)
        if cmd["op"] != "burst":
            break
        burst(n)
    deadline = cmd["deadline"]
    res: CommResult = {"allreduce": [], "allgather": [], "p2p": []}
    for nbytes in sizes:
        # every rank must stop at the same size: rank 0's clock decides (at least 3 sizes)
        stop = torch.tensor([float(time.time() > deadline and len(res["p2p"]) >= 3)], device=device)
        dist.broadcast(stop, 0)
        if stop.item():
            break
        n = max(1, nbytes // 4)
        x = torch.ones(n, dtype=torch.float32, device=device)
        part = torch.ones(max(1, n // procs), dtype=torch.float32, device=device)
        outs = [torch.empty_like(part) for _ in range(procs)]
        r = reps if nbytes < (1 << 22) else max(3, reps // 3)
        res["allreduce"].append(
            {"bytes": 4 * n, "s": _time(partial(dist.all_reduce, x), r, device)}
        )
        res["allgather"].append(
            {
                "bytes": 4 * part.numel() * procs,
                "s": _time(partial(dist.all_gather, outs, part), r, device),
            }
        )
        res["p2p"].append({"bytes": 4 * n, "s": _time(partial(_pingpong, rank, x), r, device) / 2})
    if layer_job is not None:
        res.update(_layer_runs(rank, procs, singles[rank], device, *layer_job, earlier=bursts))
    if rank == 0:
        _write(files["result"], res)
    dist.barrier()
    from megatron_hexi.process_exit import exit_process

    exit_process(0)  # never a normal interpreter exit: see megatron_hexi.process_exit


def _max_over_ranks(values: Sequence[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _mean_over_ranks(values: Sequence[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


class _TimedWork:
    """An asynchronous all-reduce's handle whose `wait` is timed into the clock's calls."""

    def __init__(self, work: Any, calls: list[tuple[float, float]]) -> None:
        self._work, self._calls = work, calls

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            self._calls.append((t0, time.perf_counter() - t0))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class AllReduceClock:
    """While entered, every `torch.distributed.all_reduce` call (megatron-core's TP layers make
    theirs through it) is timed, with its start, and so is the wait on an asynchronous one's
    handle (the backward's input-gradient all-reduce runs beside the weight-gradient GEMM): how
    much of a layer pass a rank spends inside its all-reduces (`within`), the rest being
    compute. The in-situ TP runs use it; nothing else is timed this way."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, float]] = []  # (start, seconds)
        self._plain = dist.all_reduce

    def __enter__(self) -> AllReduceClock:
        plain, calls = self._plain, self.calls

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                work = plain(*args, **kwargs)
            finally:
                calls.append((t0, time.perf_counter() - t0))
            return work if work is None else _TimedWork(work, calls)

        dist.all_reduce = timed
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_reduce = self._plain

    def within(self, start: float, end: float) -> float:
        """Seconds inside the all-reduces that started in [start, end)."""
        return sum(d for t, d in self.calls if start <= t < end)


# how long rank 0 waits before joining a "ready" all-reduce: long enough for the others to be
# inside theirs (a process that leaves a barrier is there within a millisecond on a busy VM)
READY_DELAY_S = 0.005
READY_CALLS = 15  # timed calls of a ready all-reduce (about 6 ms each with the delay)


def _ready_allreduce(
    model: ModelSpec, mbs: int, dtype: torch.dtype, device: torch.device, rank: int, reps: int
) -> float:
    """Seconds of a TP all-reduce of one activation [s, b, h] when the other ranks already wait
    in it: rank 0 joins READY_DELAY_S after them and times its call (the other ranks return 0).
    What a GPU rank with the most to compute pays at each of a layer's all-reduces when its
    partners have less (planner.measured_costs.skew_absorbed, which also says why a CPU node's
    uneven groups are charged otherwise). The median of READY_CALLS calls (or `reps`, if more):
    a step pays dozens of them, so their typical time, not the fastest call (on a 2-core VM the
    fastest of 40 took 0.38 ms at micro-batch 2, their median 0.49 ms)."""
    from megatron_hexi.profile.measure import sync

    x = torch.zeros(model.seq_length * mbs * model.hidden_size, dtype=dtype, device=device)
    out = []
    for i in range(max(reps, READY_CALLS) + 2):
        dist.barrier()
        sync(device)
        if rank == 0:
            time.sleep(READY_DELAY_S)
        t0 = time.perf_counter()
        dist.all_reduce(x)
        sync(device)
        if rank == 0 and i >= 2:
            out.append(time.perf_counter() - t0)
    return statistics.median(out) if out else 0.0


def _write(path: str, obj: object) -> None:
    """Write JSON so that a reader never sees half of it."""
    with open(path + ".part", "w") as fh:
        json.dump(obj, fh)
    os.replace(path + ".part", path)


def _wait_for(path: str, seconds: float, alive: Callable[[], bool] | None = None) -> Any:
    """Sleep-poll for `path` (a sleeping process does not slow the one that measures) and return
    its JSON; raise after `seconds`, or when `alive()` says the other side is gone."""
    end = time.monotonic() + seconds
    while not os.path.exists(path):
        if alive is not None and not alive():
            raise RuntimeError(f"hexi-profile: the other side stopped before writing {path}")
        if time.monotonic() > end:
            raise TimeoutError(f"hexi-profile: waited {seconds:.0f} s for {path}")
        time.sleep(0.05)
    with open(path) as fh:
        return json.load(fh)


def _layer_runs(
    rank: int,
    procs: int,
    single: dist.ProcessGroup,
    device: torch.device,
    model: ModelSpec,
    mbss: Sequence[int],
    reps: int,
    dtype_name: str,
    contention: int,
    attention_backend: str,
    earlier: Sequence[TrainingStep] = (),
) -> LayerRuns:
    """Layer timings that only exist with `procs` processes running at once.

    - contention (CPU; `contention` is the TP width of the reference shard): a layer stage of
      that shard timed on every rank at once, in three rounds; against the same stage timed
      alone in the compute grid it is the slowdown of `procs` processes sharing the cores. (A
      rank that waits in a gloo collective polls, so "alone" is not measured here with the others
      waiting: that would slow the one that runs.) Then the runtime itself: `procs` one-stage
      pipelines training at once (bursts during the profile (`earlier`: CommJob.burst), before
      and after the TP runs, the fastest kept), whose step against the one-rank step
      (hexi-profile's runtime runs) gives the slowdown as training meets it, collectives and all;
    - in-situ TP (when the model splits evenly `procs` ways): for each micro-batch size, a
      two-layer middle stage over a real `procs`-way TP group (the runtime's layers with their
      all-reduces) and, alternately, the same shard as a one-rank stage on every process at once,
      micro-batches back to back as training runs them.
      The planner takes the TP layer's time beyond its own compute estimate as the TP comm:
      gloo on shared cores, or NCCL beside the kernels, costs more than an idle all-reduce curve.
      The TP passes also record the time inside their all-reduce calls (`AllReduceClock`), to
      compare with what training spends in them.
    Times are per layer, the fastest round (measure.py says why); a group waits for its slowest
    rank, so each is the max over ranks.
    """
    from megatron_hexi.model import seed_rng
    from megatron_hexi.profile.measure import Stage, shard_view, splits_evenly, tp_view

    seed_rng(1234, 0)
    dtype = getattr(torch, dtype_name)
    layers = 2
    out: LayerRuns = {}
    if contention:
        ref = Stage(
            model,
            shard_view(model, contention, layers),
            max(mbss),
            device,
            dtype,
            group=single,
            attention_backend=attention_backend,
        )
        together = []
        for _ in range(3):
            dist.barrier()
            together.append(sum(ref.time(reps)))
        t = torch.tensor([min(together)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out["contention"] = {
            "procs": procs,
            "tp": contention,
            "mbs": max(mbss),
            "together_s": t.item() / layers,
        }
        from megatron_hexi.profile.runtime_overhead import data_parallel_step

        train = data_parallel_step(
            model, device, reps, procs, attention_backend
        )  # once before the TP runs
    if splits_evenly(model, procs):
        runs = {}
        for b in mbss:
            for rc in (False, True):
                runs[(b, "tp", rc)] = Stage(
                    model,
                    tp_view(model, procs, rank, layers),
                    b,
                    device,
                    dtype,
                    recompute=rc,
                    group=dist.group.WORLD,
                    attention_backend=attention_backend,
                )
                runs[(b, "shard", rc)] = Stage(
                    model,
                    shard_view(model, procs, layers),
                    b,
                    device,
                    dtype,
                    recompute=rc,
                    group=single,
                    attention_backend=attention_backend,
                )
        # per round: (forward, backward, forward inside all-reduces, backward inside them)
        got: dict[tuple[int, str, bool], list[tuple[float, ...]]] = {k: [] for k in runs}
        clock = AllReduceClock()
        # micro-batches back to back, as the schedule runs them: a pass that starts right after a
        # barrier meets its partner in step at the first all-reduce, and so hides the skew that
        # training's all-reduces wait out (the fidelity model's TP2 layer, forward + backward at
        # micro-batch 2: 19.6-22.8 ms the fastest barrier-started pass, 25.2-26.5 ms the fastest
        # mean of 4 back to back; its shard alone 16.5 ms either way). Per point, a warm-up
        # burst, then TP_ROUNDS rounds over all points (a slow spell hits one round of each),
        # each a burst of `burst` passes whose mean is the round's time.
        # Each pass also splits its time inside the all-reduce calls from the rest (`clock`).
        burst = max(3, reps // 2)
        for i in range(1 + TP_ROUNDS):
            for k, st in runs.items():
                dist.barrier()
                passes = []
                with clock:
                    for _ in range(burst):
                        del clock.calls[:]
                        fw, bw = st.run()
                        t0, t1, t2 = st.last_bounds
                        passes.append((fw, bw, clock.within(t0, t1), clock.within(t1, t2)))
                if i:
                    got[k].append(tuple(statistics.fmean(r[j] for r in passes) for j in range(4)))
        # the fastest round of each pass, with its time inside the all-reduces
        best: dict[tuple[int, str, bool], list[float]] = {}
        for k, v in got.items():
            fwd, bwd = min(v, key=lambda r: r[0]), min(v, key=lambda r: r[1])
            best[k] = [fwd[0] / layers, bwd[1] / layers, fwd[2] / layers, bwd[3] / layers]
        rows: list[TPLayerRow] = []
        for b in mbss:
            tp, tp_rc = best[(b, "tp", False)], best[(b, "tp", True)]
            vals = _max_over_ranks(
                tp[:2]
                + tp_rc[1:2]
                + best[(b, "shard", False)][:2]
                + best[(b, "shard", True)][1:2]
                + [_ready_allreduce(model, b, dtype, device, rank, reps)]
            )
            inside = _mean_over_ranks([tp[2], tp[3], tp_rc[3]])
            row: TPLayerRow = {
                "tp": procs,
                "mbs": b,
                "fwd_s": vals[0],
                "bwd_s": vals[1],
                "bwd_recompute_s": vals[2],
                "compute_fwd_s": vals[3],
                "compute_bwd_s": vals[4],
                "compute_bwd_recompute_s": vals[5],
                "allreduce_ready_s": vals[6],
            }
            if device.type == "cpu":  # records.TPLayerRow says why not on a GPU
                row["in_allreduce_fwd_s"] = inside[0]
                row["in_allreduce_bwd_s"] = inside[1]
                row["in_allreduce_bwd_recompute_s"] = inside[2]
            rows.append(row)
        out["tp_layer"] = rows
    if contention:  # and once after: the fastest burst is kept
        again = data_parallel_step(model, device, reps, procs, attention_backend)
        bursts = [b["step_s"] for b in earlier] + [train["step_s"], again["step_s"]]
        train.update({"step_s": min(bursts), "bursts_s": bursts})
        out["contention"]["training"] = train
    return out


class CommJob:
    """The `procs`-process job, started early and released later (see the module docstring).

        job = CommJob(procs, threads, "cpu", layer_job=...)   # spawns; first burst
        job.wait_ready()      # the processes sleep from here on: measure alone now
        job.burst()           # another data-parallel burst, between the parent's measurements
        result = job.finish(max_seconds)

    `layer_job`: what _layer_runs times; its `contention` (the contention reference's TP width,
    0 for none) also decides whether the processes train bursts.
    """

    def __init__(
        self,
        procs: int,
        threads: int,
        device_type: str,
        reps: int = 10,
        layer_job: LayerJob | None = None,
        max_bytes: int = 1 << 26,
        wait_s: float = 900.0,
    ) -> None:
        import socket
        import tempfile

        import torch.multiprocessing as mp

        self.procs, self.device_type = procs, device_type
        sizes, s = [], 1 << 10
        while s <= max_bytes:
            sizes.append(s)
            s *= 4
        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            port = sk.getsockname()[1]
        self._tmp = tempfile.TemporaryDirectory(prefix="hexi-profile-")
        self.files = {k: os.path.join(self._tmp.name, k + "{}.json") for k in ("cmd", "done")}
        self.files["result"] = os.path.join(self._tmp.name, "result.json")
        self.commands = 0
        env_threads = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = str(threads)
        try:
            # daemon: the processes end with hexi-profile, whatever stops it
            self._ctx = mp.start_processes(
                _worker,
                args=(
                    procs,
                    port,
                    self.files,
                    sizes,
                    reps,
                    threads,
                    device_type,
                    wait_s,
                    layer_job,
                ),
                nprocs=procs,
                join=False,
                daemon=True,
                start_method="spawn",
            )
        finally:
            if env_threads is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = env_threads
        self.ready: BurstDone | None = None

    def _alive(self) -> bool:
        return not self._ctx.join(timeout=0)  # raises, with the cause, if a process failed

    def wait_ready(self, seconds: float = 300.0) -> BurstDone:
        """Block until the processes have started (and trained their first burst)."""
        ready: BurstDone = _wait_for(self.files["done"].format(0), seconds, self._alive)
        self.ready = ready
        return ready

    def _command(self, **cmd: str | float) -> None:
        self.commands += 1
        _write(self.files["cmd"].format(self.commands), cmd)

    def burst(self, seconds: float = 300.0) -> float | None:
        """One more data-parallel burst (the processes sleep again after it); its step, or
        None when the job trains none."""
        if self.ready is None:
            self.wait_ready()
        self._command(op="burst")
        done: BurstDone = _wait_for(self.files["done"].format(self.commands), seconds, self._alive)
        return done["step_s"]

    def finish(self, max_seconds: float) -> CommRecord:
        """Let the processes measure (collective sizes stop at `max_seconds`), wait, return
        {"procs", "backend", curves, fits[, "contention", "tp_layer"]}."""
        if self.ready is None:
            self.wait_ready()
        self._command(op="measure", deadline=time.time() + max_seconds)
        try:
            while not self._ctx.join(timeout=1.0):
                pass
            with open(self.files["result"]) as fh:
                res: CommResult = json.load(fh)
        finally:
            self.close()
        n = self.procs
        fits = {
            "allreduce": fit_ring(res["allreduce"], 2 * (n - 1), 2 * (n - 1) / n),
            "allgather": fit_ring(res["allgather"], n - 1, (n - 1) / n),
            "p2p": fit_ring(res["p2p"], 1, 1),
        }
        out: CommRecord = {
            "procs": n,
            "backend": "nccl" if self.device_type == "cuda" else "gloo",
            "allreduce": res["allreduce"],
            "allgather": res["allgather"],
            "p2p": res["p2p"],
            "fit": fits,
        }
        if "contention" in res:
            out["contention"] = res["contention"]
        if "tp_layer" in res:
            out["tp_layer"] = res["tp_layer"]
        return out

    def close(self) -> None:
        """Stop the processes if they still run, and remove the job's files."""
        for p in self._ctx.processes:
            if p.is_alive():
                p.terminate()
                p.join(5)
        self._tmp.cleanup()
