"""Run many `pretrain_gpt.py` command lines in one process, each in a forked child under limits.

    python runtime_corpus_runner.py CASES.json RESULTS.json

CASES.json is a list of {"id", "argv", "env"}. The runtime (torch, megatron-core) is imported
once here; each case runs `megatron_hexi.training.main(argv)` in a child forked from this process
with `env` added to its environment, its address space limited to what this process maps plus
EXTRA_ADDRESS_SPACE and its CPU time to CPU_SECONDS; a child still running after WALL_SECONDS
(blocked, not computing: a FIFO opened for writing) is killed with SIGALRM and reported as a hang.
One process each, so `main` starts a one-rank process group on an in-process store, as a run
started without a launcher does. RESULTS.json maps each id to its exit code (negative: killed by
that signal), stdout, stderr, CPU seconds and peak resident memory. An uncaught exception is
printed as a traceback with exit code 1, as Python would.
"""

import json
import os
import resource
import signal
import sys
import tempfile
import traceback

EXTRA_ADDRESS_SPACE = 3 * 2**30  # a tiny run's model, optimizer and data on top of the imports
CPU_SECONDS = 60
WALL_SECONDS = 90


def _mapped_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def _child(argv, env, out_fd, err_fd, address_space):
    code = 1
    try:
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        sys.stdout = open(1, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
        sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
        os.environ.update(env)
        resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))
        resource.setrlimit(resource.RLIMIT_CPU, (CPU_SECONDS, CPU_SECONDS))
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(WALL_SECONDS)
        from megatron_hexi.training import main

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


def run_case(argv, env, address_space):
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(argv, env, out.fileno(), err.fileno(), address_space)
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
    import megatron.core  # noqa: F401  (imported once here, not in every child)
    import torch  # noqa: F401

    import megatron_hexi.training  # noqa: F401

    address_space = _mapped_bytes() + EXTRA_ADDRESS_SPACE
    cases = json.loads(open(cases_path).read())
    results = {}
    for case in cases:
        results[case["id"]] = run_case(
            [str(a) for a in case["argv"]], case.get("env", {}), address_space
        )
    with open(results_path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
