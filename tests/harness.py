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

run_distributed's ranks and the scripts of run_script / run_ranks / start_script are forked from
one forkserver per test session that imported torch and megatron-core once (tests/forkserver.py):
each is still a fresh process. No process any of them starts may exit with SIGABRT (-6).
"""

from __future__ import annotations

import faulthandler
import importlib
import importlib.util
import multiprocessing
import os
import pickle
import queue as queue_module
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from unittest import mock

import forkserver

# What every process started by the harness sees first: no GPU (the tests are CPU tests).
CPU_ONLY_ENV = {"CUDA_VISIBLE_DEVICES": ""}
# One compute thread per rank unless `env` says otherwise: the ranks of a job share the cores,
# and torch's default (one thread per core in each rank) oversubscribes them several times.
THREADS_ENV = {"OMP_NUM_THREADS": "1"}
# Set for the ranks of a job that `run_distributed(stuck_in=...)` watches: seconds between stack
# dumps.
_STACK_EVERY_ENV = "HEXI_HARNESS_STACK_EVERY"
# How a watched job is recognised as stuck: every unfinished rank's stack names the function and is
# unchanged over this many dumps in a row, `_STACK_EVERY` s apart.
_STACK_EVERY = 1.0
_STUCK_DUMPS = 3
# The exit a rank must never have: SIGABRT, the interpreter's finalisation meeting gloo threads.
SIGABRT_EXIT = -signal.SIGABRT


class DistributedTestError(AssertionError):
    """A rank raised, died, or the job ran past its timeout. The message says which and why."""


class DistributedTimeout(DistributedTestError):
    """The job ran past its timeout; every process was killed."""

    def __init__(self, message, stdout="", stderr=""):
        super().__init__(message)
        self.stdout, self.stderr = stdout, stderr


# The ports `free_port` hands out lie below the kernel's ephemeral range (32768-60999 on Linux,
# where bind(0) and every outgoing connection take theirs), so a port chosen here is not taken by
# some connection before the rank that is given it binds it. Parallel test workers (pytest-xdist)
# each take their own slice, so no two of them hand out the same port. The localhost Slurm's ports
# (17001-17003, 17817-17818) and its jobs' (25000-29999) lie outside.
PORT_RANGE = (20000, 25000)
_next_port = None


def _port_slice():
    """[first, end) of this process's ports: PORT_RANGE, or this xdist worker's share of it."""
    first, end = PORT_RANGE
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # gw0, gw1, ...
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if worker.startswith("gw") and worker[2:].isdigit() and count > 1:
        width = (end - first) // count
        first += int(worker[2:]) * width
        end = first + width
    return first, end


def free_port():
    """A TCP port that is free right now (nothing listens on it, on any address), from this
    process's slice of PORT_RANGE. Successive calls walk the slice from a random start, so a port
    comes back only after all the others (not while a closed connection on it lingers), and two
    test runs on one machine rarely try the same port at the same time."""
    global _next_port
    first, end = _port_slice()
    if _next_port is None or not first <= _next_port < end:
        _next_port = first + random.SystemRandom().randrange(end - first)
    for _ in range(end - first):
        port, _next_port = _next_port, first + (_next_port + 1 - first) % (end - first)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"free_port: no free TCP port in {first}..{end - 1}")


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


def _worker(
    ref, rank, world_size, port, env, args, kwargs, results, deadline, pg_timeout, stacks, parent
):
    """Body of one rank (a forked or spawned process). Puts exactly one message unless it is
    killed. `parent`: (environment, sys.path) of the caller, which a forked rank takes over."""
    dist = None
    try:
        if parent is not None:
            forkserver.enter(*parent)
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
        if parent is not None:
            forkserver.use_threads()
        # If this rank is still running just before the parent kills it, dump its stacks (where
        # a hang is) to a file of its own: ranks dumping to one stderr at the same moment
        # interleave their lines. The parent prints the files one after another.
        stack_file = open(stacks, "w")
        if os.environ.get(_STACK_EVERY_ENV):  # the caller watches where the ranks are
            faulthandler.dump_traceback_later(
                float(os.environ[_STACK_EVERY_ENV]), repeat=True, exit=False, file=stack_file
            )
        else:
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


class _StuckWatch:
    """Reads the stack dumps of the unfinished ranks of a job whose ranks dump every
    `_STACK_EVERY` s (faulthandler: each dump starts "Timeout (...)!"); says when all of them sit
    in the function `name` without moving."""

    def __init__(self, name, stacks):
        self.name, self.stacks = name, stacks
        self.seen = {}  # rank -> (its last complete dump, how many dumps in a row it is the same)
        self.counted = {}  # rank -> dumps in its file when last read

    def stuck(self, ranks):
        for r in ranks:
            try:
                with open(self.stacks[r]) as f:
                    dumps = f.read().split("Timeout (")
            except OSError:
                return False
            # the last dump may be half written; count each complete one once
            if len(dumps) < 3 or len(dumps) == self.counted.get(r):
                continue
            self.counted[r] = len(dumps)
            dump = dumps[-2].split("\n", 1)[-1]  # without the header's time
            same, count = self.seen.get(r, ("", 0))
            self.seen[r] = (dump, count + 1 if dump == same else 1)
        return all(
            f"in {self.name}" in self.seen.get(r, ("", 0))[0] and self.seen[r][1] >= _STUCK_DUMPS
            for r in ranks
        )

    def last(self, rank):
        return self.seen[rank][0]


def run_distributed(
    fn,
    world_size,
    *args,
    timeout=120,
    env=None,
    hide_cuda=True,
    stuck_in=None,
    fresh=False,
    **kwargs,
):
    """Run fn(*args, **kwargs) on `world_size` gloo ranks (fresh processes); per-rank results.

    Each rank gets MASTER_ADDR=127.0.0.1, a free MASTER_PORT, RANK, WORLD_SIZE and LOCAL_RANK,
    CUDA_VISIBLE_DEVICES="" unless `hide_cuda` is False (and `env`, applied after it and before
    fn's module is imported), an initialised default gloo process group, and returns fn's value,
    which must pickle. Raises DistributedTestError (an AssertionError, so pytest reports a
    failure) with the rank's traceback if a rank raises or dies, and DistributedTimeout, after
    killing every process, if the job is not done in `timeout` seconds. A rank that returned but
    then exits with SIGABRT (-6) fails the job too.

    The ranks are forked from the session's forkserver (torch and megatron-core imported once).
    They are spawned instead (fresh interpreters, torch imported after `env` is set) with
    `fresh=True` (benchmarks), and whenever they may see a GPU (`hide_cuda=False`, or `env`
    setting CUDA_VISIBLE_DEVICES), so that CUDA starts afresh in each.

    `stuck_in`: the job is expected to hang in a function of this name. The ranks dump their
    stacks every second, and as soon as every unfinished rank has sat in that function, its stack
    unchanged, for three dumps in a row, the job is killed as if timed out (DistributedTimeout,
    each stuck rank's last stack on stderr): a deliberate hang is told apart from a slow run in
    seconds, by where each rank is.
    """
    ref = _function_ref(fn)
    env = {**(CPU_ONLY_ENV if hide_cuda else {}), **THREADS_ENV, **(env or {})}
    if stuck_in:
        env[_STACK_EVERY_ENV] = str(_STACK_EVERY)
    if fresh or env.get("CUDA_VISIBLE_DEVICES", ""):
        ctx, parent = multiprocessing.get_context("spawn"), None
    else:
        ctx, parent = forkserver.context(), (dict(os.environ), None, list(sys.path))
    results = ctx.Queue()
    port = free_port()
    start = time.monotonic()
    deadline = time.time() + timeout
    procs = []
    stack_dir = tempfile.TemporaryDirectory(prefix="harness-stacks-")
    stacks = [os.path.join(stack_dir.name, f"rank{r}") for r in range(world_size)]
    watch = _StuckWatch(stuck_in, stacks) if stuck_in else None
    next_look = start + _STACK_EVERY
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
                    parent,
                ),
            )
            with mock.patch.dict(os.environ, env):  # a spawned interpreter starts with it
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
            missing = [r for r in range(world_size) if r not in done]
            stuck = False
            if watch is not None and time.monotonic() >= next_look:
                next_look = time.monotonic() + _STACK_EVERY
                stuck = watch.stuck(missing)
            if left <= 0 or stuck:
                _kill(procs)
                for r in missing:
                    if stuck:
                        dump = watch.last(r)
                    else:
                        dump = open(stacks[r]).read() if os.path.exists(stacks[r]) else ""
                    sys.stderr.write(f"--- stacks of rank {r} just before the kill ---\n{dump}")
                sys.stderr.flush()
                why = (
                    f"stuck in {stuck_in} (stacks unchanged over {_STUCK_DUMPS} dumps) after "
                    f"{time.monotonic() - start:.1f} s"
                    if stuck
                    else f"timed out after {timeout:g} s"
                )
                raise DistributedTimeout(
                    f"run_distributed({fn.__qualname__}, world_size={world_size}) {why}: "
                    f"rank(s) {missing} had not finished (finished: {sorted(done)}); all "
                    f"processes killed. Stacks of the stuck ranks, if they got that far, are in "
                    f"the captured stderr."
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
        aborted = [r for r, p in enumerate(procs) if p.exitcode == SIGABRT_EXIT]
        if aborted:
            raise DistributedTestError(
                f"rank(s) {aborted} of {world_size} returned, then exited with SIGABRT (-6)"
            )
        return [done[r] for r in range(world_size)]
    finally:
        _kill(procs)
        stack_dir.cleanup()
        results.close()
        results.join_thread()


class ScriptProcess:
    """A `python SCRIPT` forked from the forkserver (`start_script`), read like a Popen: its pid,
    poll() (the exit code, None while it runs; -N after signal N), wait(), kill() and
    send_signal()."""

    def __init__(self, process):
        self.process, self.pid = process, process.pid

    def poll(self):
        return self.process.exitcode

    def wait(self, timeout=None):
        self.process.join(timeout)
        return self.process.exitcode

    def kill(self):
        self.process.kill()

    def send_signal(self, signum):
        os.kill(self.pid, signum)


def start_script(argv, environ, cwd, stdout_path, stderr_path, new_session=False):
    """`python ARGV...` (ARGV[0] a script) forked from the forkserver, with exactly the
    environment `environ`, in the folder `cwd`, its output written to the two files; returns a
    ScriptProcess at once. Its `sys.path` is a fresh interpreter's: the script's folder, then
    the folders of environ's PYTHONPATH, then site-packages. `new_session`: see
    forkserver.run_script."""
    argv = [str(a) for a in argv]
    cwd = os.path.abspath(cwd or os.getcwd())
    script = os.path.join(cwd, argv[0])
    extra = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys_path = [os.path.dirname(script), *extra]
    sys_path += [p for p in forkserver.fresh_sys_path() if p not in sys_path]
    p = forkserver.context().Process(
        target=forkserver.run_script,
        args=(
            [script, *argv[1:]],
            environ,
            cwd,
            sys_path,
            stdout_path,
            stderr_path,
            new_session,
        ),
    )
    p.start()
    return ScriptProcess(p)


def _start_scripts(argvs, envs, cwd):
    """Each `python ARGV...` of `argvs` as a process forked from the forkserver, with the
    environment (the caller's, updated with envs[i]) and the folder `cwd`. Returns the processes,
    their (stdout, stderr) file pairs and the temporary folder holding them (`_finish_scripts`
    removes it)."""
    folder = tempfile.TemporaryDirectory(prefix="harness-script-")
    procs, files = [], []
    for i, (argv, env) in enumerate(zip(argvs, envs)):
        out, err = os.path.join(folder.name, f"{i}.out"), os.path.join(folder.name, f"{i}.err")
        procs.append(start_script(argv, {**os.environ, **env}, cwd, out, err).process)
        files.append((out, err))
    return procs, files, folder


def check_no_abort(codes, what):
    """The harness's rule for every launch: no process exits with SIGABRT (-6) (the
    interpreter's finalisation meeting gloo threads, megatron_hexi.process_exit)."""
    aborted = [i for i, code in enumerate(codes) if code == SIGABRT_EXIT]
    if aborted:
        raise DistributedTestError(f"process(es) {aborted} of {what} exited with SIGABRT (-6)")


def _read(path):
    with open(path, encoding=sys.getdefaultencoding(), errors="replace") as f:
        return f.read()


def _finish_scripts(argvs, procs, files, folder, timeout):
    """Wait for the processes of `_start_scripts`; [(exit code, stdout, stderr)] per process.
    Past `timeout` s all are killed and subprocess.TimeoutExpired is raised; an exit by SIGABRT
    (-6) fails the launch (DistributedTestError), whatever the test expects."""
    deadline = time.monotonic() + timeout
    try:
        for argv, p in zip(argvs, procs):
            p.join(max(deadline - time.monotonic(), 0))
            if p.exitcode is None:
                raise subprocess.TimeoutExpired([sys.executable, *map(str, argv)], timeout)
        out = [(p.exitcode, _read(o), _read(e)) for p, (o, e) in zip(procs, files)]
    finally:
        _kill(procs)
        folder.cleanup()
    what = f"`python {' '.join(map(str, argvs[0]))}`"
    try:
        check_no_abort([code for code, _, _ in out], what)
    except DistributedTestError as e:
        tails = [err[-3000:] for code, _, err in out if code == SIGABRT_EXIT]
        raise DistributedTestError("\n".join([str(e), *tails]))
    return out


def run_script(argv, timeout=180, env=None, cwd=None):
    """`python ARGV...` (ARGV[0] a script) as one fresh process forked from the forkserver, with
    CUDA hidden and one compute thread unless `env` says otherwise: (exit code, stdout, stderr),
    as subprocess.run would give them, in a fraction of the start-up time. A process that
    exits with SIGABRT fails the test. For what only a fresh interpreter shows (the launcher
    itself, import-time settings), use subprocess."""
    env = {**CPU_ONLY_ENV, **THREADS_ENV, **(env or {})}
    procs, files, folder = _start_scripts([argv], [env], cwd)
    return _finish_scripts([argv], procs, files, folder, timeout)[0]


def run_script_with_environ(argv, environ, timeout=180, cwd=None):
    """run_script with exactly the environment `environ` (nothing added or kept from this
    process's): (exit code, stdout, stderr)."""
    folder = tempfile.TemporaryDirectory(prefix="harness-script-")
    files = (os.path.join(folder.name, "0.out"), os.path.join(folder.name, "0.err"))
    p = start_script(argv, environ, cwd, *files)
    return _finish_scripts([argv], [p.process], [files], folder, timeout)[0]


def run_ranks(argv, world, timeout=240, env=None, cwd=None):
    """`python ARGV...` as `world` plain processes with torchrun's environment (RANK, LOCAL_RANK,
    LOCAL_WORLD_SIZE, WORLD_SIZE, a free MASTER_PORT, one thread each, CUDA hidden). Not torchrun
    itself: its agent stops the other workers as soon as one fails, so each rank's own exit code
    and error would depend on timing. Returns [(exit code, stdout, stderr)] per rank. The
    processes are forked from the forkserver (see run_script); one that exits with SIGABRT (-6)
    fails the test."""
    port = str(free_port())
    envs = [
        {
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
        for rank in range(world)
    ]
    argvs = [argv] * world
    procs, files, folder = _start_scripts(argvs, envs, cwd)
    return _finish_scripts(argvs, procs, files, folder, timeout)


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
