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
import sys

from foundation.entry_corpus_runner import Limits, mapped_bytes, run_case

EXTRA_ADDRESS_SPACE = 384 * 2**20  # a few hundred MB on top of the imported planner
CPU_SECONDS = 20
WALL_SECONDS = 300


def main(cases_path, results_path):
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    import planner.cli
    import planner.search_cli  # noqa: F401  (imported once here, not in every child)

    planner.cli.build_parser()
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    limits = Limits(mapped_bytes() + EXTRA_ADDRESS_SPACE, CPU_SECONDS, CPU_SECONDS, WALL_SECONDS)
    cases = json.loads(open(cases_path).read())
    results = {"_base_rss_mb": base_rss, "_extra_address_space_mb": EXTRA_ADDRESS_SPACE / 2**20}
    for case in cases:
        results[case["id"]] = run_case(planner.cli.main, [str(a) for a in case["argv"]], limits)
    with open(results_path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
