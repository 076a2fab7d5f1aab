"""Shared by the conversion and data corpora: a case, the run of a whole corpus in one forked,
memory-capped subprocess (entry_corpus_runner.py), and the category of each outcome.

The categories are those of a hostile-input audit: "one line" (exit 2, one line with the tool's
error prefix naming the field; the only good outcome for a refusal), "traceback", "hang" (the
child spent its CPU limit, or waited past the wall-clock limit), "out of memory", "silently
wrong" (exit 0 where a refusal belongs), "read outside" (exit 0 after reading a file outside
the folder given), "data lost" (a file the run must keep changed), "other" (exit 2, but not one
line naming the field)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).parent
REPO = HERE.parent.parent
CONVERT = f"{REPO / 'tools' / 'convert_hf_llama.py'}:main"
PREPROCESS = f"{REPO / 'tools' / 'preprocess_data.py'}:main"
DATA_STARTUP = f"{HERE / 'entry_corpus.py'}:data_startup"
CATEGORIES = (
    "one line",
    "traceback",
    "hang",
    "out of memory",
    "silently wrong",
    "read outside",
    "data lost",
    "other",
)
MAX_CPU_SECONDS = 10.0  # per case, of the child (CPU, not wall clock: the machine may be busy)


@dataclass
class Case:
    """One command line of an entry, and what a refusal must say."""

    id: str
    entry: str  # CONVERT, PREPROCESS or DATA_STARTUP
    argv: list
    field: str  # in the error line
    prefix: str = ""  # the error line starts with it ("" : the entry's "NAME: error: ")
    keep: list = field(default_factory=list)  # files whose bytes must not change
    on_success: str = "silently wrong"  # the category of an exit 0
    unprivileged: bool = False  # run as nobody (root writes into read-only folders)


ERROR_PREFIX = {
    CONVERT: "convert_hf_llama.py: error: ",
    PREPROCESS: "preprocess_data.py: error: ",
    DATA_STARTUP: "pretrain_gpt.py: error: ",
}


def fingerprint(path) -> str | None:
    path = Path(path)
    if not path.exists():
        return None
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run_corpus(cases: list[Case], tmp: Path, preload=()) -> dict:
    """Run every case once, in one runner process; returns {id: result} with "category" added."""
    kept = {c.id: {str(p): fingerprint(p) for p in c.keep} for c in cases}
    spec = {
        "preload": list(preload),
        "cases": [
            {
                "id": c.id,
                "entry": c.entry,
                "argv": [str(a) for a in c.argv],
                "unprivileged": c.unprivileged,
            }
            for c in cases
        ],
    }
    (tmp / "cases.json").write_text(json.dumps(spec))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    # forked from the harness's forkserver (torch and megatron-core imported there); imported
    # here: the runner loads this module too, without the test helpers on its path
    from harness import run_script_with_environ

    code, _, err = run_script_with_environ(
        [HERE / "entry_corpus_runner.py", tmp / "cases.json", tmp / "results.json"],
        env,
        timeout=1800,
        cwd=REPO,
    )
    assert code == 0, err
    results = json.loads((tmp / "results.json").read_text())
    for c in cases:
        got = results[c.id]
        got["changed"] = [p for p, h in kept[c.id].items() if fingerprint(p) != h]
        got["category"] = category(c, got)
    return results


def category(case: Case, got: dict) -> str:
    err, code = got["stderr"], got["exit"]
    if got["changed"]:
        return "data lost"
    if code == 0:
        return case.on_success
    if "MemoryError" in err or "bad_alloc" in err or code in (-signal.SIGABRT, -signal.SIGKILL):
        return "out of memory"
    if code in (-signal.SIGXCPU, -signal.SIGALRM):
        return "hang"
    if "Traceback" in err or code != 2:
        return "traceback"
    prefix = case.prefix or ERROR_PREFIX[case.entry]
    lines = err.splitlines()
    if len(lines) == 1 and lines[0].startswith(prefix) and case.field in lines[0]:
        return "one line"
    return "other"


def counts(results: dict, cases: list[Case]) -> dict[str, int]:
    got = Counter(results[c.id]["category"] for c in cases)
    return {k: got[k] for k in CATEGORIES if got[k]}


def check(case: Case, got: dict) -> None:
    """The case is one clear line, within the CPU limit, with nothing it must keep changed."""
    assert got["category"] == "one line", (case.field, got)
    assert got["stdout"] == "", got
    assert got["cpu_seconds"] < MAX_CPU_SECONDS, got


def data_startup(argv) -> int:
    """pretrain_gpt.py's start-up up to its datasets, in this process and without a process
    group: its arguments, the plan, the tokenizer, then the training and (with --eval-iters)
    validation datasets, through the functions training itself calls; a SpecError is printed as
    pretrain_gpt.py prints it."""
    from megatron_hexi.arguments import parse_args, run_config
    from megatron_hexi.run_datasets import build_dataset, build_valid_dataset
    from megatron_hexi.tokenizer import build_tokenizer
    from planner.errors import SpecError
    from planner.plan import load_plan

    try:
        args = parse_args(argv)
        config = run_config(args)
        plan = load_plan(args.hetero_plan_path)
        tokenizer = build_tokenizer(config.data)
        build_dataset(plan, config, tokenizer)
        if config.evaluation.batches:
            build_valid_dataset(plan, config, tokenizer)
    except SpecError as e:
        for line in e.problems:
            print(f"pretrain_gpt.py: error: {line}", file=sys.stderr, flush=True)
        return 2
    return 0
