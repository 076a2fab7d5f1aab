"""Run many command lines of any entry point in one process, each in a forked child under hard
limits (the conversion and data corpora; cli_corpus_runner.py does the same for `hexi-plan`).

    python entry_corpus_runner.py CASES.json RESULTS.json

CASES.json is {"preload": [module, ...], "cases": [{"id", "entry", "argv", "unprivileged"}]}.
`entry` is "MODULE:FUNCTION" or "FILE.py:FUNCTION" (a tools/ script, loaded from its file); the
function takes the argv list and returns the exit code, like a `main`. Every entry and preload
module is imported once here, so a case costs a fork, not an interpreter start. Each child has its
address space limited to what this process maps plus EXTRA_ADDRESS_SPACE and its CPU time to
CPU_SECONDS (a busy loop, megatron-core's epoch count on an empty split for one, ends as SIGXCPU;
WALL_SECONDS is a safety net for a child that waits). `unprivileged` cases drop root to nobody
first, so that a read-only folder is read-only. RESULTS.json maps each id to its exit code
(negative: killed by that signal), stdout, stderr, CPU seconds and peak resident memory; an
uncaught exception is a traceback on stderr with exit code 1, as Python would print it.
"""

import importlib
import importlib.util
import json
import os
import resource
import signal
import sys
import tempfile
import traceback
from typing import NamedTuple

EXTRA_ADDRESS_SPACE = 1024 * 2**20  # a GB on top of the imported torch and megatron-core
CPU_SECONDS = 20
WALL_SECONDS = 120
NOBODY = 65534


def mapped_bytes():
    """This process's address space, which a forked child starts with."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def load_entry(entry):
    """The function an entry names, importing its module (once: modules are cached)."""
    where, func = entry.rsplit(":", 1)
    if where.endswith(".py"):
        name = "corpus_entry_" + os.path.splitext(os.path.basename(where))[0]
        if name not in sys.modules:
            spec = importlib.util.spec_from_file_location(name, where)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        return getattr(sys.modules[name], func)
    return getattr(importlib.import_module(where), func)


class Limits(NamedTuple):
    """What one case may use: address space, CPU seconds (soft: SIGXCPU; hard: SIGKILL) and
    wall seconds (SIGALRM: a safety net for a child that waits instead of computing)."""

    address_space: int
    cpu_soft: int
    cpu_hard: int
    wall: int


def _child(function, argv, out_fd, err_fd, limits, unprivileged, env):
    code = 1
    try:
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        # whatever sys.stdout/err were (a test runner's capture), write to the case's files
        sys.stdout = open(1, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
        sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
        os.environ.update(env)
        if unprivileged and os.geteuid() == 0:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
        resource.setrlimit(resource.RLIMIT_AS, (limits.address_space, limits.address_space))
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_soft, limits.cpu_hard))
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(limits.wall)
        code = function(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code if isinstance(code, int) else 1)


def run_case(function, argv, limits, unprivileged=False, env=None):
    """`function(argv)` in a forked child under `limits`: its exit code (negative: killed by
    that signal), stdout, stderr, CPU seconds and peak resident memory."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(function, argv, out.fileno(), err.fileno(), limits, unprivileged, env or {})
        _, status, usage = os.wait4(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return {
            "exit": code,
            "stdout": out.read().decode("utf-8", "replace"),
            "stderr": err.read().decode("utf-8", "replace"),
            "cpu_seconds": usage.ru_utime + usage.ru_stime,
            "max_rss_mb": usage.ru_maxrss / 1024,
        }


def main(cases_path, results_path):
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "RAYON_NUM_THREADS"):
        os.environ.setdefault(name, "1")
    spec = json.loads(open(cases_path).read())
    for module in spec.get("preload", []):
        importlib.import_module(module)
    functions = {c["entry"]: load_entry(c["entry"]) for c in spec["cases"]}
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    # soft CPU limit: SIGXCPU (a hang); the hard limit's SIGKILL only if that is ignored
    address_space = mapped_bytes() + EXTRA_ADDRESS_SPACE
    limits = Limits(address_space, CPU_SECONDS, CPU_SECONDS + 5, WALL_SECONDS)
    results = {"_base_rss_mb": base_rss, "_extra_address_space_mb": EXTRA_ADDRESS_SPACE / 2**20}
    for case in spec["cases"]:
        results[case["id"]] = run_case(
            functions[case["entry"]],
            [str(a) for a in case["argv"]],
            limits,
            case.get("unprivileged", False),
        )
    with open(results_path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
