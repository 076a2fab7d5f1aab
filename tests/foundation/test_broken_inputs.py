"""Every broken plan and cluster file in the corpus gives one clear line: exit 2, the field named,
no traceback. In-process for speed, plus a few real `hexi-plan` subprocesses."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"
PLANS = {k: v for k, v in json.loads((DATA / "broken_plans.json").read_text()).items()
         if not k.startswith("_")}
CLUSTERS = {k: v for k, v in json.loads((DATA / "broken_clusters.json").read_text()).items()
            if not k.startswith("_")}
ERROR = "hexi-plan: error: "


def test_corpus_is_complete():
    assert sorted(PLANS) == sorted(p.name for p in (DATA / "broken_plans").glob("*.json"))
    assert sorted(CLUSTERS) == sorted(p.name for p in (DATA / "broken_clusters").glob("*.yaml"))
    assert len(PLANS) >= 22 and len(CLUSTERS) >= 12


def _one_line(err, path, field):
    lines = err.splitlines()
    assert "Traceback" not in err
    assert len(lines) == 1, f"expected one error line, got:\n{err}"
    assert lines[0].startswith(f"{ERROR}{path}: "), lines[0]
    assert field in lines[0], f"{field!r} not named in: {lines[0]}"
    return lines[0]


@pytest.mark.parametrize("name", sorted(PLANS))
def test_broken_plan(name, hexi_plan):
    path = DATA / "broken_plans" / name
    code, out, err = hexi_plan("validate", path)
    assert code == 2 and out == ""
    _one_line(err, path, PLANS[name]["field"])


@pytest.mark.parametrize("name", sorted(CLUSTERS))
def test_broken_cluster(name, hexi_plan, examples_dir, tmp_path):
    path = DATA / "broken_clusters" / name
    code, out, err = hexi_plan("manual", "--cluster", path, "--model", "tiny",
                               "--global-batch-size", 8,
                               "--pipelines", examples_dir / "pipelines" / "one-rank.json",
                               "-o", tmp_path / "plan.json")
    assert code == 2 and out == ""
    _one_line(err, path, CLUSTERS[name])
    assert not (tmp_path / "plan.json").exists()


def test_broken_plan_fails_plan_from_dict_too():
    """The runtime's entry (load_plan) raises the same one-line PlanError."""
    from planner import PlanError, load_plan
    path = DATA / "broken_plans" / "shard-sum-ffn.json"
    with pytest.raises(PlanError) as info:
        load_plan(path)
    assert info.value.problems == [f"{path}: pipelines[0].stages[0].shards.ffn: sums to 224, "
                                   f"model ffn_hidden_size is 256"]


def test_manual_input_errors(hexi_plan, examples_dir, tmp_path):
    cluster = examples_dir / "clusters" / "mini-hetero.yaml"
    pipelines = examples_dir / "pipelines" / "hetero-4rank.json"
    base = ["manual", "--cluster", cluster, "-o", tmp_path / "p.json"]
    cases = [
        (["--model", "llama9", "--global-batch-size", 8, "--pipelines", pipelines], "--model"),
        (["--model", "tiny", "--global-batch-size", 8, "--pipelines", tmp_path / "none.json"],
         "cannot read pipelines file"),
        (["--model", "tiny", "--global-batch-size", 9, "--pipelines", pipelines],
         "training.global_batch_size is 9"),
        (["--model", "tiny-gqa", "--global-batch-size", 8, "--pipelines", pipelines],
         "pipelines[0].stages[0].shards.ffn: sums to 256, model ffn_hidden_size is 192"),
        (["--model", "tiny", "--global-batch-size", 8, "--pipelines",
          examples_dir / "pipelines" / "mixed-lab.json"], "pipelines: use rank 35"),
    ]
    for extra, field in cases:
        code, out, err = hexi_plan(*base, *extra)
        assert code == 2 and "Traceback" not in err, err
        assert field in err.splitlines()[0], err
        assert all(line.startswith(ERROR) for line in err.splitlines())
        # tiny-gqa has other ffn and vocab sizes: two problems, two lines
        assert len(err.splitlines()) == (2 if "tiny-gqa" in extra else 1), err


@pytest.mark.parametrize("args, field", [
    (["validate", "tests/foundation/data/broken_plans/layers-gap.json"],
     "pipelines[0].stages[1].layers"),
    (["validate", "tests/foundation/data/broken_plans/invalid-json.json"], "not valid JSON"),
    (["manual", "--cluster", "tests/foundation/data/broken_clusters/ambiguous-unit.yaml",
      "--model", "tiny", "--global-batch-size", "8", "--pipelines",
      "examples/pipelines/one-rank.json", "-o", "/nonexistent/plan.json"],
     "nodes[1] (rtx3090).nic"),
])
def test_real_subprocess(args, field, repo_root):
    for cmd in ([sys.executable, "-m", "planner"], [str(Path(sys.executable).parent / "hexi-plan")]):
        if not Path(cmd[0]).exists():
            continue
        r = subprocess.run(cmd + args, cwd=repo_root, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and r.stdout == ""
        _one_line(r.stderr, args[-1] if args[0] == "validate" else args[2], field)
