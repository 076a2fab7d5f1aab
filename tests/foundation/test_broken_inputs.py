"""Every broken plan, cluster file, model file and CLI number gives one clear line: exit 2, the
field named, no traceback, within a bounded CPU time and amount of memory.

The whole corpus runs through the real `hexi-plan` entry (`planner.cli.main`) in ONE subprocess
(cli_corpus_runner.py), each case in a forked child with its address space and CPU time limited;
the tests below read that run's per-case results."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
DATA = HERE / "data"
REPO = HERE.parent.parent
PLANS = {
    k: v
    for k, v in json.loads((DATA / "broken_plans.json").read_text()).items()
    if not k.startswith("_")
}
CLUSTERS = {
    k: v
    for k, v in json.loads((DATA / "broken_clusters.json").read_text()).items()
    if not k.startswith("_")
}
MODELS = {
    k: v
    for k, v in json.loads((DATA / "broken_models.json").read_text()).items()
    if not k.startswith("_")
}
ERROR = "hexi-plan: error: "
# per case, CPU seconds of the child (not wall clock: a loaded machine must not fail the test);
# generous, as the largest generated files below take ~2 s. Speed itself lives in benchmarks.
MAX_CPU_SECONDS = 10.0
MAX_GROWTH_MB = 256  # peak resident memory above the runner's own (planner imported)

CLUSTER = REPO / "examples" / "clusters" / "mini-hetero.yaml"
ONE_RANK = REPO / "examples" / "pipelines" / "one-rank.json"
# `plan` and `manual` with bad numbers on the command line: (id, argv, field)
FLAG_CASES = [
    (
        "plan --seq-length -5",
        ["plan", "--model", "tiny", "--global-batch-size", "8", "--seq-length", "-5"],
        "argument --seq-length",
    ),
    (
        "plan --seq-length=-5",
        ["plan", "--model", "tiny", "--global-batch-size", "8", "--seq-length=-5"],
        "argument --seq-length",
    ),
    (
        "plan --seq-length 0",
        ["plan", "--model", "tiny", "--global-batch-size", "8", "--seq-length", "0"],
        "argument --seq-length",
    ),
    (
        "plan --seq-length huge",
        ["plan", "--model", "tiny", "--global-batch-size", "8", "--seq-length", "9" * 5000],
        "argument --seq-length",
    ),
    (
        "plan --global-batch-size 0",
        ["plan", "--model", "tiny", "--global-batch-size", "0"],
        "argument --global-batch-size",
    ),
    (
        "plan --global-batch-size nan",
        ["plan", "--model", "tiny", "--global-batch-size", "nan"],
        "argument --global-batch-size",
    ),
    (
        "plan --global-batch-size inf",
        ["plan", "--model", "tiny", "--global-batch-size", "inf"],
        "argument --global-batch-size",
    ),
    (
        "plan --global-batch-size 1e9",
        ["plan", "--model", "tiny", "--global-batch-size", "1e9"],
        "argument --global-batch-size",
    ),
    (
        "plan --global-batch-size 10^12",
        ["plan", "--model", "tiny", "--global-batch-size", "1000000000000"],
        "argument --global-batch-size",
    ),
    (
        "plan --micro-batch-size -1",
        ["plan", "--model", "tiny", "--global-batch-size", "8", "--micro-batch-size", "-1"],
        "argument --micro-batch-size",
    ),
    (
        "plan --micro-batch-size nan",
        ["plan", "--model", "tiny", "--global-batch-size", "8", "--micro-batch-size", "nan"],
        "argument --micro-batch-size",
    ),
    (
        "plan --seed -1",
        ["plan", "--model", "tiny", "--global-batch-size", "8", "--seed", "-1"],
        "argument --seed",
    ),
    (
        "plan --seed 2^40",
        ["plan", "--model", "tiny", "--global-batch-size", "8", "--seed", str(2**40)],
        "argument --seed",
    ),
    ("plan without --model", ["plan", "--global-batch-size", "8"], "--model"),
    (
        "manual --seq-length -5",
        [
            "manual",
            "--model",
            "tiny",
            "--global-batch-size",
            "8",
            "--pipelines",
            ONE_RANK,
            "--seq-length",
            "-5",
        ],
        "argument --seq-length",
    ),
    (
        "manual --global-batch-size nan",
        ["manual", "--model", "tiny", "--global-batch-size", "nan", "--pipelines", ONE_RANK],
        "argument --global-batch-size",
    ),
    (
        "manual --global-batch-size 0",
        ["manual", "--model", "tiny", "--global-batch-size", "0", "--pipelines", ONE_RANK],
        "argument --global-batch-size",
    ),
    (
        "manual pipelines deep",
        [
            "manual",
            "--model",
            "tiny",
            "--global-batch-size",
            "8",
            "--pipelines",
            DATA / "broken_plans" / "deep-nesting.json",
        ],
        "nested too deeply",
    ),
    (
        "manual pipelines utf16",
        [
            "manual",
            "--model",
            "tiny",
            "--global-batch-size",
            "8",
            "--pipelines",
            DATA / "broken_plans" / "utf16.json",
        ],
        "not UTF-8",
    ),
]


def _generated(out_dir):
    """Large inputs written at test time: (id, argv, path, text of the last line, line count)."""
    from planner import limits

    out = out_dir / "plan.json"
    manual = ["--model", "tiny", "--global-batch-size", 8, "--pipelines", ONE_RANK, "-o", out]
    cases = []
    flat_yaml = out_dir / "flat.yaml"  # one line of empty lists, past the node limit
    flat_yaml.write_text("name: [" + "[]," * (limits.MAX_YAML_NODES + 10) + "]\n")
    cases.append(
        (
            "generated flat YAML",
            ["manual", "--cluster", flat_yaml, *manual],
            flat_yaml,
            f"line 1: not valid YAML: more than {limits.MAX_YAML_NODES:,} values",
            1,
        )
    )
    big_yaml = out_dir / "big.yaml"
    big_yaml.write_text("name: x\n#" + "x" * limits.MAX_YAML_FILE_BYTES + "\n")
    cases.append(
        (
            "generated YAML over the byte limit",
            ["manual", "--cluster", big_yaml, *manual],
            big_yaml,
            "cluster file is larger than the limit",
            1,
        )
    )
    flat_json = out_dir / "flat.json"  # 16 MB of zeros: parsed, walked, refused
    flat_json.write_text("[" + "0," * (8 * 2**20) + "0]")
    for cmd in ("validate", "show"):
        cases.append(
            (
                f"generated flat JSON {cmd}",
                [cmd, flat_json],
                flat_json,
                "plan: must be a JSON object",
                1,
            )
        )
    links = out_dir / "links.yaml"
    links.write_text(
        CLUSTER.read_text()
        + "\nlinks:\n"
        + "".join(
            "  - {between: [a100, rtx4090], bandwidth: 1 GB/s}\n"
            for _ in range(limits.MAX_LINKS + 1)
        )
    )
    cases.append(
        (
            "generated too many links",
            ["manual", "--cluster", links, *manual],
            links,
            f"links: {limits.MAX_LINKS + 1:,} link overrides, above the limit",
            1,
        )
    )
    plan = json.loads((DATA / "broken_plans" / "duplicate-key.json").read_text())
    many = out_dir / "many-problems.json"
    many.write_text(json.dumps({**plan, **{f"x{i}": 1 for i in range(50)}}))
    cases.append(
        (
            "generated many problems",
            ["validate", many],
            many,
            f"... and {50 - limits.MAX_REPORTED_PROBLEMS} more problems",
            limits.MAX_REPORTED_PROBLEMS + 1,
        )
    )
    return cases


def _cases(out_dir):
    """(id, argv, path the line must start with or None, field, line count) for the whole
    corpus; `field` is in the last line."""
    out = out_dir / "plan.json"
    cases = []
    for name, meta in PLANS.items():
        path = DATA / "broken_plans" / name
        for cmd in ("validate", "show", "simulate"):
            cases.append((f"{cmd} {name}", [cmd, path], path, meta["field"]))
    for name, field in CLUSTERS.items():
        path = DATA / "broken_clusters" / name
        cases.append(
            (
                f"manual --cluster {name}",
                [
                    "manual",
                    "--cluster",
                    path,
                    "--model",
                    "tiny",
                    "--global-batch-size",
                    8,
                    "--pipelines",
                    ONE_RANK,
                    "-o",
                    out,
                ],
                path,
                field,
            )
        )
    for name, field in MODELS.items():
        path = DATA / "broken_models" / name
        cases.append(
            (
                f"manual --model {name}",
                [
                    "manual",
                    "--cluster",
                    CLUSTER,
                    "--model",
                    path,
                    "--global-batch-size",
                    8,
                    "--pipelines",
                    ONE_RANK,
                    "-o",
                    out,
                ],
                path,
                field,
            )
        )
        cases.append(
            (
                f"plan --model {name}",
                [
                    "plan",
                    "--cluster",
                    CLUSTER,
                    "--model",
                    path,
                    "--global-batch-size",
                    8,
                    "-o",
                    out,
                ],
                path,
                field,
            )
        )
    for case_id, argv, field in FLAG_CASES:
        cmd, rest = argv[0], argv[1:]
        cases.append((case_id, [cmd, "--cluster", CLUSTER, *rest, "-o", out], None, field))
    return [c if len(c) == 5 else (*c, 1) for c in cases] + _generated(out_dir)


@pytest.fixture(scope="module")
def corpus_run(tmp_path_factory):
    """Run every case once, in one subprocess; returns (cases by id, results by id, out dir)."""
    tmp = tmp_path_factory.mktemp("corpus")
    cases = _cases(tmp)
    (tmp / "cases.json").write_text(
        json.dumps([{"id": i, "argv": [str(a) for a in argv]} for i, argv, _, _, _ in cases])
    )
    env = {
        **os.environ,
        "OPENBLAS_NUM_THREADS": "1",
        # the repository, and tests/ for the runner's helpers (`foundation.entry_corpus_runner`)
        "PYTHONPATH": os.pathsep.join(
            [str(REPO), str(HERE.parent), os.environ.get("PYTHONPATH", "")]
        ),
    }
    r = subprocess.run(
        [
            sys.executable,
            str(HERE / "cli_corpus_runner.py"),
            str(tmp / "cases.json"),
            str(tmp / "results.json"),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr
    return (
        {i: (argv, path, field, lines) for i, argv, path, field, lines in cases},
        json.loads((tmp / "results.json").read_text()),
        tmp,
    )


def test_corpus_is_complete():
    assert sorted(PLANS) == sorted(p.name for p in (DATA / "broken_plans").glob("*.json"))
    assert sorted(CLUSTERS) == sorted(p.name for p in (DATA / "broken_clusters").glob("*.yaml"))
    assert sorted(MODELS) == sorted(p.name for p in (DATA / "broken_models").glob("*.yaml"))
    assert len(PLANS) >= 60 and len(CLUSTERS) >= 30 and len(MODELS) >= 10


def _one_line(err, path, field, count=1):
    lines = err.splitlines()
    assert "Traceback" not in err
    assert len(lines) == count, f"expected {count} error line(s), got:\n{err}"
    prefix = f"{ERROR}{path}: " if path is not None else ERROR
    assert all(line.startswith(prefix if count == 1 else ERROR) for line in lines), lines
    assert field in lines[-1], f"{field!r} not named in: {lines[-1]}"
    return lines[-1]


def _check(corpus_run, case_id):
    cases, results, out_dir = corpus_run
    argv, path, field, count = cases[case_id]
    got = results[case_id]
    assert "Traceback" not in got["stderr"], got["stderr"]
    assert got["exit"] == 2 and got["stdout"] == "", got
    _one_line(got["stderr"], path, field, count)
    assert got["cpu_seconds"] < MAX_CPU_SECONDS, got
    assert got["max_rss_mb"] - results["_base_rss_mb"] < MAX_GROWTH_MB, got
    assert not (out_dir / "plan.json").exists()


@pytest.mark.parametrize("cmd", ["validate", "show", "simulate"])
@pytest.mark.parametrize("name", sorted(PLANS))
def test_broken_plan(name, cmd, corpus_run):
    _check(corpus_run, f"{cmd} {name}")


@pytest.mark.parametrize("name", sorted(CLUSTERS))
def test_broken_cluster(name, corpus_run):
    _check(corpus_run, f"manual --cluster {name}")


@pytest.mark.parametrize("cmd", ["manual", "plan"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_broken_model(name, cmd, corpus_run):
    _check(corpus_run, f"{cmd} --model {name}")


@pytest.mark.parametrize("case_id", [c[0] for c in FLAG_CASES])
def test_bad_flag(case_id, corpus_run):
    _check(corpus_run, case_id)


@pytest.mark.parametrize(
    "case_id",
    [
        "generated flat YAML",
        "generated YAML over the byte limit",
        "generated flat JSON validate",
        "generated flat JSON show",
        "generated too many links",
        "generated many problems",
    ],
)
def test_generated_large_input(case_id, corpus_run):
    _check(corpus_run, case_id)


def test_runner_catches_a_traceback_and_a_memory_blowup(tmp_path):
    """The limits are real: a child that leaks past the address-space limit, or raises, shows up
    as a non-2 exit with a traceback (so the corpus checks above can fail)."""
    from foundation import cli_corpus_runner as runner

    limits = runner.Limits(
        runner.mapped_bytes() + runner.EXTRA_ADDRESS_SPACE,
        runner.CPU_SECONDS,
        runner.CPU_SECONDS,
        runner.WALL_SECONDS,
    )
    blowup = runner.run_case(
        lambda argv: len(bytearray(2 * runner.EXTRA_ADDRESS_SPACE)), ["validate", "x"], limits
    )
    crash = runner.run_case(lambda argv: 1 // 0, ["validate", "x"], limits)
    assert blowup["exit"] == 1 and "MemoryError" in blowup["stderr"], blowup
    assert crash["exit"] == 1 and "Traceback" in crash["stderr"], crash


def test_broken_plan_fails_plan_from_dict_too():
    """The runtime's entry (load_plan) raises the same one-line PlanError."""
    from planner import PlanError, load_plan

    path = DATA / "broken_plans" / "shard-sum-ffn.json"
    with pytest.raises(PlanError) as info:
        load_plan(path)
    assert info.value.problems == [
        f"{path}: pipelines[0].stages[0].shards.ffn: sums to 224, model ffn_hidden_size is 256"
    ]


def test_manual_input_errors(hexi_plan, examples_dir, tmp_path):
    cluster = examples_dir / "clusters" / "mini-hetero.yaml"
    pipelines = examples_dir / "pipelines" / "hetero-4rank.json"
    base = ["manual", "--cluster", cluster, "-o", tmp_path / "p.json"]
    cases = [
        (["--model", "llama9", "--global-batch-size", 8, "--pipelines", pipelines], "--model"),
        (
            ["--model", "tiny", "--global-batch-size", 8, "--pipelines", tmp_path / "none.json"],
            "cannot read pipelines file",
        ),
        (
            ["--model", "tiny", "--global-batch-size", 9, "--pipelines", pipelines],
            "training.global_batch_size is 9",
        ),
        (
            ["--model", "tiny-gqa", "--global-batch-size", 8, "--pipelines", pipelines],
            "pipelines[0].stages[0].shards.ffn: sums to 256, model ffn_hidden_size is 192",
        ),
        (
            [
                "--model",
                "tiny",
                "--global-batch-size",
                8,
                "--pipelines",
                examples_dir / "pipelines" / "mixed-lab.json",
            ],
            "pipelines: use rank 35",
        ),
    ]
    for extra, field in cases:
        code, out, err = hexi_plan(*base, *extra)
        assert code == 2 and "Traceback" not in err, err
        assert field in err.splitlines()[0], err
        assert all(line.startswith(ERROR) for line in err.splitlines())
        # tiny-gqa has other ffn and vocab sizes: two problems, two lines
        assert len(err.splitlines()) == (2 if "tiny-gqa" in extra else 1), err


@pytest.mark.parametrize(
    "args, field",
    [
        (
            ["validate", "tests/foundation/data/broken_plans/layers-gap.json"],
            "pipelines[0].stages[1].layers",
        ),
        (["validate", "tests/foundation/data/broken_plans/invalid-json.json"], "not valid JSON"),
        (
            [
                "manual",
                "--cluster",
                "tests/foundation/data/broken_clusters/ambiguous-unit.yaml",
                "--model",
                "tiny",
                "--global-batch-size",
                "8",
                "--pipelines",
                "examples/pipelines/one-rank.json",
                "-o",
                "/nonexistent/plan.json",
            ],
            "nodes[1] (rtx3090).nic",
        ),
    ],
)
def test_real_subprocess(args, field, repo_root):
    for cmd in (
        [sys.executable, "-m", "planner"],
        [str(Path(sys.executable).parent / "hexi-plan")],
    ):
        if not Path(cmd[0]).exists():
            continue
        r = subprocess.run(cmd + args, cwd=repo_root, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and r.stdout == ""
        _one_line(r.stderr, args[-1] if args[0] == "validate" else args[2], field)
