"""Processes that start in milliseconds: forked from a server that imported torch, megatron-core
and the runtime once.

A process that imports torch and megatron-core spends several seconds doing it on a small
machine; the suite starts a few hundred of them (rank processes, pretrain_gpt.py launches). Here
one forkserver per test session pays for the imports, and every rank or script is a fresh fork of
it: its own process, so whatever it changes (environment, monkeypatches, process groups) ends
with it, and its exit code is its own (a signal is -N, as for a subprocess).

What a fork does not give on its own is done before the job runs: the caller's environment and
working directory (the server's date from its start), the caller's `sys.path` for test modules,
and torch's compute threads (read from OMP_NUM_THREADS when torch was imported: 1 in the server;
`torch.set_num_threads` sets the job's).

A job that must see something only a fresh interpreter gives (a different CUDA_VISIBLE_DEVICES, an
import-time setting) is started the ordinary way by its caller (`spawn`, a subprocess).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from unittest import mock

from megatron_hexi.rank_imports import rank_modules

# Imported once in the server (megatron_hexi.rank_imports, which tools/setup_env.sh compiles).
PRELOAD = rank_modules()
# The server's environment when it starts: its torch sees no GPU and runs one compute thread.
SERVER_ENV = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}

_context = None
_fresh_path: list[str] | None = None


def context():
    """The forkserver multiprocessing context, its server started with the preloaded modules."""
    global _context
    if _context is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        with mock.patch.dict(os.environ, SERVER_ENV):
            from multiprocessing import forkserver

            forkserver.ensure_running()
        # The server imports the preloaded modules before it forks anything: wait for that here,
        # so that no job's timeout counts the imports.
        ready = ctx.Process(target=os.getpid)
        ready.start()
        ready.join()
        _context = ctx
    return _context


def fresh_sys_path():
    """`sys.path` of a fresh interpreter after its script directory (site-packages, editable
    installs): what `python SCRIPT` sees besides the script's own folder."""
    global _fresh_path
    if _fresh_path is None:
        out = subprocess.run(
            [sys.executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"],
            capture_output=True,
            text=True,
            check=True,
            cwd="/",
        ).stdout
        _fresh_path = json.loads(out)
    return _fresh_path


def enter(environ, cwd=None, sys_path=None):
    """In a forked job: take the caller's environment, folder and `sys.path`, and the compute
    threads OMP_NUM_THREADS asks for."""
    os.environ.clear()
    os.environ.update(environ)
    if cwd is not None:
        os.chdir(cwd)
    if sys_path is not None:
        sys.path[:] = sys_path
    use_threads()


def use_threads():
    """torch's compute threads as OMP_NUM_THREADS (in the environment now) asks."""
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))


def run_script(argv, environ, cwd, sys_path, stdout_path, stderr_path, new_session=False):
    """Body of a forked job: `python ARGV...` (ARGV[0] a script path) as `python` would run it,
    its standard output and error written to the two files; ends the process with the script's
    exit code (1 after an uncaught exception, printed as the interpreter prints it). `sys_path`:
    the script's folder, then `fresh_sys_path()` (computed by the caller, once). `new_session`:
    the process leads a session and process group of its own (what `start_new_session` gives a
    subprocess), so that its group can be signalled."""
    import atexit
    import runpy
    import threading
    import traceback

    if new_session:
        os.setsid()
    for fd, path in ((1, stdout_path), (2, stderr_path)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    enter(environ, cwd, sys_path)
    sys.argv = [str(a) for a in argv]
    code = 0
    try:
        runpy.run_path(str(argv[0]), run_name="__main__")
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
        traceback.print_exc()
        code = 1
    # The interpreter's own ending, short of finalisation: wait for threads, run atexit.
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
