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
import sys

from foundation.entry_corpus_runner import Limits, mapped_bytes, run_case

EXTRA_ADDRESS_SPACE = 3 * 2**30  # a tiny run's model, optimizer and data on top of the imports
CPU_SECONDS = 60
WALL_SECONDS = 90


def main(cases_path, results_path):
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    import megatron.core  # noqa: F401  (imported once here, not in every child)
    import torch  # noqa: F401

    from megatron_hexi.training import main as entry

    limits = Limits(mapped_bytes() + EXTRA_ADDRESS_SPACE, CPU_SECONDS, CPU_SECONDS, WALL_SECONDS)
    cases = json.loads(open(cases_path).read())
    results = {}
    for case in cases:
        results[case["id"]] = run_case(
            entry, [str(a) for a in case["argv"]], limits, env=case.get("env", {})
        )
    with open(results_path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
