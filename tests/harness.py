"""Multi-process CPU test harness: run a function on N gloo ranks, or a script under torchrun.

    from harness import run_distributed, run_torchrun

    def _allreduce(x):                      # module level: the ranks import it by name
        import torch, torch.distributed as dist
        t = torch.tensor([x + dist.get_rank()])
        dist.all_reduce(t)
        return t.item()

    def test_sum():
        assert run_distributed(_allreduce, 2, 10, timeout=60) == [21, 21]

Both pin the CPU: every process they start gets CUDA_VISIBLE_DEVICES="" before it imports torch,
so the suite runs the CPU path on a GPU host too. Only `hide_cuda=False` (a benchmark on a GPU)
or `env` setting CUDA_VISIBLE_DEVICES shows it a GPU.

Neither call ever hangs: past `timeout` every process is killed and the test fails, saying which
ranks had not finished. A rank that raises fails the test with that rank's number and traceback.
"""

from __future__ import annotations

import faulthandler
import importlib
import importlib.util
import multiprocessing
import os
import pickle
import queue as queue_module
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from unittest import mock

# What every process started by the harness sees first: no GPU (the tests are CPU tests).
CPU_ONLY_ENV = {"CUDA_VISIBLE_DEVICES": ""}
# One compute thread per rank unless `env` says otherwise: the ranks of a job share the cores,
# and torch's default (one thread per core in each rank) oversubscribes them several times.
THREADS_ENV = {"OMP_NUM_THREADS": "1"}


class DistributedTestError(AssertionError):
    """A rank raised, died, or the job ran past its timeout. The message says which and why."""


class DistributedTimeout(DistributedTestError):
    """The job ran past its timeout; every process was killed."""

    def __init__(self, message, stdout="", stderr=""):
        super().__init__(message)
        self.stdout, self.stderr = stdout, stderr


def free_port():
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _function_ref(fn):
    """(module name, qualified name, file) by which a spawned process finds `fn` again."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or module == "__main__" or "<" in qualname:
        raise ValueError(
            f"run_distributed: {fn!r} must be a module-level function of an importable "
            f"module (not a lambda, a closure or a function of __main__)"
        )
    return module, qualname, getattr(sys.modules.get(module), "__file__", None)


def _resolve(module, qualname, path):
    try:
        mod = importlib.import_module(module)
    except ImportError:
        if not path:
            raise
        spec = importlib.util.spec_from_file_location(module, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[module] = mod
        spec.loader.exec_module(mod)
    obj = mod
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _worker(ref, rank, world_size, port, env, args, kwargs, results, deadline, pg_timeout, stacks):
    """Body of one rank (a spawned process). Puts exactly one message unless it is killed."""
    dist = None
    try:
        os.environ.update(
            {
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(world_size),
            }
        )
        os.environ.update(env or {})
        # If this rank is still running just before the parent kills it, dump its stacks (where
        # a hang is) to a file of its own: ranks dumping to one stderr at the same moment
        # interleave their lines. The parent prints the files one after another.
        stack_file = open(stacks, "w")
        faulthandler.dump_traceback_later(
            max(deadline - time.time() - 1.0, 0.5), exit=False, file=stack_file
        )
        fn = _resolve(*ref)
        import datetime

        import torch
        import torch.distributed as dist

        threads = int(os.environ["OMP_NUM_THREADS"])
        if torch.get_num_threads() != threads:
            raise RuntimeError(
                f"rank {rank} runs {torch.get_num_threads()} compute threads, not "
                f"OMP_NUM_THREADS={threads}: torch was imported before the setting"
            )
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=pg_timeout)
        )
        payload = pickle.dumps(fn(*args, **kwargs))
        message = (rank, "ok", payload)
    except BaseException:  # noqa: BLE001 - report everything, SystemExit included
        message = (rank, "error", traceback.format_exc())
    # Report before tearing the group down: peers blocked in a collective with this rank only fail
    # once it is gone, so the rank that raised first is also the first to report.
    results.put(message)
    try:
        if dist is not None and dist.is_initialized():
            dist.destroy_process_group()
    finally:
        faulthandler.cancel_dump_traceback_later()
        # Deliver the message, then leave without the interpreter's slow teardown (torch's).
        results.close()
        results.join_thread()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _descendants(pid):
    """Every process below `pid`, read from /proc (Linux; elsewhere none are found)."""
    children = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _kill_tree(pid, group=False):
    """SIGKILL `pid` (its process group too if `group`) and everything it started, even in
    other sessions (torchrun starts each worker in a new session)."""
    below = _descendants(pid)
    try:
        if group:
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for child in below:
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _kill(procs):
    for p in procs:
        if p.is_alive():
            _kill_tree(p.pid)
    for p in procs:
        p.join(timeout=10)


def run_distributed(fn, world_size, *args, timeout=120, env=None, hide_cuda=True, **kwargs):
    """Run fn(*args, **kwargs) on `world_size` gloo ranks (spawned processes); per-rank results.

    Each rank gets MASTER_ADDR=127.0.0.1, a free MASTER_PORT, RANK, WORLD_SIZE and LOCAL_RANK,
    CUDA_VISIBLE_DEVICES="" unless `hide_cuda` is False (and `env`, applied after it and before
    fn's module is imported), an initialised default gloo process group, and returns fn's value,
    which must pickle. Raises DistributedTestError (an AssertionError, so pytest reports a
    failure) with the rank's traceback if a rank raises or dies, and DistributedTimeout, after
    killing every process, if the job is not done in `timeout` seconds.
    """
    ref = _function_ref(fn)
    env = {**(CPU_ONLY_ENV if hide_cuda else {}), **THREADS_ENV, **(env or {})}
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    start = time.monotonic()
    deadline = time.time() + timeout
    procs = []
    stack_dir = tempfile.TemporaryDirectory(prefix="harness-stacks-")
    stacks = [os.path.join(stack_dir.name, f"rank{r}") for r in range(world_size)]
    try:
        for rank in range(world_size):
            p = ctx.Process(
                target=_worker,
                name=f"rank{rank}",
                args=(
                    ref,
                    rank,
                    world_size,
                    port,
                    env,
                    args,
                    kwargs,
                    results,
                    deadline,
                    timeout,
                    stacks[rank],
                ),
            )
            with mock.patch.dict(os.environ, env):  # the spawned interpreter starts with it
                p.start()
            procs.append(p)
        done = {}

        def take(msg):
            rank, status, payload = msg
            if status == "error":
                errors = [(rank, payload)]
                # Let the other ranks' errors (often consequences) arrive, then report them all,
                # the first one first.
                grace = time.monotonic() + 1.0
                while time.monotonic() < grace:
                    try:
                        r, st, pl = results.get(timeout=max(grace - time.monotonic(), 0.01))
                    except queue_module.Empty:
                        break
                    if st == "error":
                        errors.append((r, pl))
                text = "\n".join(f"rank {r} of {world_size} raised:\n{tb}" for r, tb in errors)
                raise DistributedTestError(text)
            try:
                done[rank] = pickle.loads(payload)
            except Exception:  # noqa: BLE001
                raise DistributedTestError(
                    f"rank {rank}: cannot unpickle its result:\n{traceback.format_exc()}"
                )

        while len(done) < world_size:
            left = timeout - (time.monotonic() - start)
            if left <= 0:
                missing = [r for r in range(world_size) if r not in done]
                _kill(procs)
                for r in missing:
                    dump = open(stacks[r]).read() if os.path.exists(stacks[r]) else ""
                    sys.stderr.write(f"--- stacks of rank {r} just before the kill ---\n{dump}")
                sys.stderr.flush()
                raise DistributedTimeout(
                    f"run_distributed({fn.__qualname__}, world_size={world_size}) timed out after "
                    f"{timeout:g} s: rank(s) {missing} had not finished (finished: "
                    f"{sorted(done)}); all processes killed. Stacks of the stuck ranks, if "
                    f"they got that far, are in the captured stderr."
                )
            try:
                take(results.get(timeout=min(left, 0.2)))
                continue
            except queue_module.Empty:
                pass
            dead = [r for r, p in enumerate(procs) if r not in done and p.exitcode is not None]
            if dead:
                # A dead process flushed its message before exiting; read whatever is there.
                try:
                    while True:
                        take(results.get(timeout=0.5))
                except queue_module.Empty:
                    pass
                for r in dead:
                    if r not in done:
                        raise DistributedTestError(
                            f"rank {r} of {world_size} exited with code {procs[r].exitcode} "
                            f"without returning a result (killed, crashed, or os._exit)"
                        )
        for p in procs:
            p.join(timeout=max(1.0, timeout - (time.monotonic() - start)))
        return [done[r] for r in range(world_size)]
    finally:
        _kill(procs)
        stack_dir.cleanup()
        results.close()
        results.join_thread()


def run_ranks(argv, world, timeout=240, env=None, cwd=None):
    """`python ARGV...` as `world` plain processes with torchrun's environment (RANK, LOCAL_RANK,
    LOCAL_WORLD_SIZE, WORLD_SIZE, a free MASTER_PORT, one thread each, CUDA hidden). Not torchrun
    itself: its agent stops the other workers as soon as one fails, so each rank's own exit code
    and error would depend on timing. Returns [(exit code, stdout, stderr)] per rank."""
    port = str(free_port())
    procs = []
    for rank in range(world):
        e = {
            **os.environ,
            **CPU_ONLY_ENV,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "OMP_NUM_THREADS": "1",
            **(env or {}),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, *map(str, argv)],
                env=e,
                cwd=cwd,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
        )
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout)
            out.append((p.returncode, stdout, stderr))
    finally:
        for p in procs:
            p.kill()
    return out


def run_torchrun(args, nproc, timeout, env=None, hide_cuda=True):
    """`python -m torch.distributed.run --nproc-per-node N --master-port FREE ARGS...`.

    The job sees no GPU (CUDA_VISIBLE_DEVICES="") unless `hide_cuda` is False or `env` sets
    CUDA_VISIBLE_DEVICES. Returns (returncode, stdout, stderr). Runs in its own process group;
    past `timeout` seconds the whole group is killed and DistributedTimeout is raised, carrying
    the output so far.
    """
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        *[str(a) for a in args],
    ]
    full_env = {**os.environ, **(CPU_ONLY_ENV if hide_cuda else {}), **(env or {})}
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(proc.pid, group=True)
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # a grandchild escaped the group and holds the pipes
            proc.kill()
            out, err = "", ""
        raise DistributedTimeout(
            f"torchrun {' '.join(map(str, args))} (nproc {nproc}) timed out after {timeout:g} s; "
            f"process group killed\n--- stdout (tail) ---\n{out[-3000:]}\n"
            f"--- stderr (tail) ---\n{err[-3000:]}",
            out,
            err,
        )
    finally:
        if proc.returncode is None:  # not reaped yet, so its pid and group id are still ours
            _kill_tree(proc.pid, group=True)
            proc.wait()
    return proc.returncode, out, err
