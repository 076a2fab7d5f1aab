"""Run many `hexi-plan` command lines in one process, each in a forked child under hard limits.

    python cli_corpus_runner.py CASES.json RESULTS.json

CASES.json is a list of {"id": ..., "argv": [...]}. Each case runs `planner.cli.main(argv)` in a
child forked from this process (the planner is imported once, so a case costs milliseconds, not
an interpreter start), with its address space limited to what this process maps plus
EXTRA_ADDRESS_SPACE and its CPU time to CPU_SECONDS (a hang without CPU use is ended after
WALL_SECONDS, a safety net only). RESULTS.json maps each id to its exit code (negative: killed by
that signal), stdout, stderr, the child's CPU seconds (user + system, from its own rusage) and
peak resident memory (the child's ru_maxrss, which starts at this process's own, also reported).
An uncaught exception is printed as a traceback on stderr with exit code 1, as Python would.
"""

import json
import os
import resource
import signal
import sys
import tempfile
import traceback

EXTRA_ADDRESS_SPACE = 384 * 2**20  # a few hundred MB on top of the imported planner
CPU_SECONDS = 20
WALL_SECONDS = 300


def _mapped_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def _child(argv, out_fd, err_fd, address_space):
    code = 1
    try:
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        # whatever sys.stdout/err were (a test runner's capture), write to the case's files
        sys.stdout = open(1, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
        sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
        resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))
        resource.setrlimit(resource.RLIMIT_CPU, (CPU_SECONDS, CPU_SECONDS))
        signal.alarm(WALL_SECONDS)
        from planner.cli import main

        code = main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code if isinstance(code, int) else 1)


def run_case(argv, address_space):
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(argv, out.fileno(), err.fileno(), address_space)
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
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    import planner.cli
    import planner.search_cli  # noqa: F401  (imported once here, not in every child)

    planner.cli.build_parser()
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    address_space = _mapped_bytes() + EXTRA_ADDRESS_SPACE
    cases = json.loads(open(cases_path).read())
    results = {"_base_rss_mb": base_rss, "_extra_address_space_mb": EXTRA_ADDRESS_SPACE / 2**20}
    for case in cases:
        results[case["id"]] = run_case([str(a) for a in case["argv"]], address_space)
    with open(results_path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
