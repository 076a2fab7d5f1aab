"""tools/bench/gpu_check.py on CPU: its cases run and pass, and a broken result makes it fail.

The GPU check itself needs a GPU; its logic (planning, launching, reading metrics, checks, the
table, exit codes) is the same with --device cpu and a tiny model, which is what runs here.
"""

import copy
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO
from harness import run_script_with_environ

SCRIPT = REPO / "tools" / "bench" / "gpu_check.py"


def _run(*args, timeout=240):
    """`python gpu_check.py ARGS...` with this process's environment, as subprocess.run would
    run it, but forked from the session's forkserver (torch already imported: the script's
    own start costs no import; its torchrun launches are fresh processes as ever)."""
    argv = [str(SCRIPT), *map(str, args)]
    code, out, err = run_script_with_environ(argv, dict(os.environ), timeout=timeout, cwd=REPO)
    return subprocess.CompletedProcess([sys.executable, *argv], code, out, err)


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """One CPU run of the save and resume cases (the slow part: two one-rank launches)."""
    out = tmp_path_factory.mktemp("gpu_check")
    r = _run(
        "--device",
        "cpu",
        "--cases",
        "save",
        "resume",
        "--iters",
        "3",
        "--save-at",
        "2",
        "--warmup",
        "1",
        "--out",
        out,
    )
    return r, out


def test_cpu_mode_passes_and_prints_the_table(cpu_run):
    r, out = cpu_run
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "| case | step s (median) |" in r.stdout
    assert "| resume vs uninterrupted | ok | iterations 3-3: identical" in r.stdout
    assert "| save: loss decreases | ok |" in r.stdout
    result = json.loads((out / "gpu_check.json").read_text())
    assert sorted(result["cases"]) == ["resume", "save"]
    assert all(c["ok"] for c in result["checks"])
    assert (out / "gpu_check.md").read_text().startswith("# gpu_check: CPU (cpu)")


def _recheck(tmp_path, result):
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(result))
    return _run("--recheck", path, timeout=60)


def test_resume_that_does_not_match_fails(cpu_run, tmp_path):
    result = json.loads((cpu_run[1] / "gpu_check.json").read_text())
    assert _recheck(tmp_path, result).returncode == 0  # unchanged: still passes
    broken = copy.deepcopy(result)
    broken["cases"]["resume"]["metrics"][0]["lm_loss"] *= 1 + 1e-7  # one resumed loss off
    r = _recheck(tmp_path, broken)
    assert r.returncode == 1, r.stdout
    assert "| resume vs uninterrupted | FAIL |" in r.stdout
    assert "1 FAILED" in r.stdout


def test_failed_or_diverging_case_fails(cpu_run, tmp_path):
    result = json.loads((cpu_run[1] / "gpu_check.json").read_text())
    broken = copy.deepcopy(result)
    broken["cases"]["save"]["metrics"][0]["lm_loss"] = float("nan")
    broken["cases"]["resume"]["rc"] = 1
    r = _recheck(tmp_path, broken)
    assert r.returncode == 1
    assert "| save: losses finite | FAIL |" in r.stdout
    assert "| resume: finished | FAIL | exit 1" in r.stdout
    assert "| resume vs uninterrupted | FAIL | save or resume did not finish |" in r.stdout


def test_no_cuda_is_one_line_and_exit_2():
    r = _run("--device", "cuda", timeout=120)  # the tests hide CUDA (conftest)
    assert r.returncode == 2
    assert r.stderr.strip().startswith("gpu_check: no CUDA device visible to torch")
    assert len(r.stderr.strip().splitlines()) == 1 and r.stdout == ""


def _cases_module():
    spec = importlib.util.spec_from_file_location(
        "gpu_check_cases", REPO / "tools" / "bench" / "_gpu_check_cases.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_missing_megatron_core_is_named(monkeypatch):
    module = _cases_module()
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name.startswith("megatron") else real(name, *a),
    )
    with pytest.raises(module.Missing, match=r"megatron-core==0\.16\.1 is missing"):
        module.check_prerequisites("cuda")


@pytest.fixture(scope="module")
def perf_run(tmp_path_factory):
    """One CPU run of a performance pair: the runtime and plain megatron-core, fusions on (off
    on CPU either way), 8 micro-batches of 1 (two one-rank launches, ~6 s each); the graphs case
    is skipped on CPU."""
    out = tmp_path_factory.mktemp("gpu_check_perf")
    cases = ["hexi-fused-1x8", "megatron-fused-1x8", "hexi-graphs-1x8"]
    r = _run(
        "--device", "cpu", "--cases", *cases, "--iters", "3", "--out", out,
        "--results", out / "raw.json",
    )  # fmt: skip
    return r, out


def test_megatron_case_runs_and_is_compared_with_the_runtime(perf_run):
    r, out = perf_run
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.startswith("graphs cases skipped: CUDA graphs run on CUDA only\n")
    rows = [line for line in r.stdout.splitlines() if line.startswith("| fused | 1 x 8 | ")]
    assert len(rows) == 1 and "- /" not in rows[0] and "(-)" not in rows[0], rows
    assert "| megatron-fused-1x8: first loss near ln(vocab) | ok |" in r.stdout
    assert "| megatron-fused-1x8: loss decreases | ok |" in r.stdout
    result = json.loads((out / "gpu_check.json").read_text())
    assert result == json.loads((out / "raw.json").read_text())  # the raw file, final
    assert sorted(result["cases"]) == ["hexi-fused-1x8", "megatron-fused-1x8"]
    assert result["skipped"] == ["graphs cases skipped: CUDA graphs run on CUDA only"]
    v = result["versions"]
    assert v["megatron_core"] == "0.16.1" and v["torch"] and v["driver"] is None
    for case in result["cases"]:
        metrics = result["cases"][case]["metrics"]
        assert [m["iteration"] for m in metrics] == [1, 2, 3]
        for key in ("lm_loss", "step_time_s", "tokens_per_s", "mfu", "grad_norm"):
            assert all(isinstance(m[key], float) and m[key] > 0 for m in metrics), key
        # the last step is profiled (host time), and left out of the timing
        assert [m.get("profiled", False) for m in metrics] == [False, False, True]
        assert 0 < metrics[-1]["host_s"] <= 10 * metrics[-1]["step_time_s"]
    # megatron-core ran with the fusion settings of the runtime's TransformerConfig
    fusions = result["cases"]["megatron-fused-1x8"]["metrics"][0]["fusions"]
    assert set(fusions) >= {"bias_activation_fusion", "gradient_accumulation_fusion"}
    assert not any(fusions.values())  # on CPU every fusion is off
    ratio = result["against_megatron"]["fused-1x8"]
    assert ratio["tokens_per_s_ratio"] > 0 and ratio["step_time_ratio"] > 0
    assert all(c["ok"] for c in result["checks"])


def test_table_for_the_benchmark_page(perf_run):
    r = _run("--table", perf_run[1] / "raw.json", timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("| variant | micro-batches | step s: runtime / megatron-core")
    assert len(lines) == 3 and lines[2].startswith("| fused | 1 x 8 | ")


def test_broken_megatron_case_fails(perf_run, tmp_path):
    result = json.loads((perf_run[1] / "gpu_check.json").read_text())
    broken = copy.deepcopy(result)
    broken["cases"]["megatron-fused-1x8"]["metrics"][-1]["lm_loss"] = float("inf")
    r = _recheck(tmp_path, broken)
    assert r.returncode == 1
    assert "| megatron-fused-1x8: losses finite | FAIL |" in r.stdout


def test_a_spent_budget_runs_nothing_and_says_so(tmp_path):
    raw = tmp_path / "raw.json"
    r = _run(
        "--device", "cpu", "--cases", "hexi-fused-1x8", "--budget-s", "0", "--out", "",
        "--results", raw, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads(raw.read_text())
    assert result["cases"] == {} and len(result["skipped"]) == 1
    assert result["skipped"][0].startswith("hexi-fused-1x8 not run: ")
    assert result["skipped"][0].endswith(" s of the 0 s budget left")


def test_performance_cases_are_skipped_when_the_model_does_not_fit(monkeypatch):
    module = _cases_module()
    import torch

    def gpu_of(gb):
        monkeypatch.setattr(
            torch.cuda,
            "get_device_properties",
            lambda _: type("Props", (), {"total_memory": gb * 1e9})(),
        )

    estimate = {"peak_memory_gb": [29.2]}
    gpu_of(80)
    assert module.perf_fits(estimate, "cuda") is None
    gpu_of(24)
    line = module.perf_fits(estimate, "cuda")
    assert line.startswith("performance cases skipped: the planner predicts a peak of 29.2 GB")
    assert module.perf_fits(estimate, "cpu") is None


def test_skips_say_why():
    module = _cases_module()
    assert module.skip_reason("hexi-fused-1x8", "cpu", "no te") is None
    assert module.skip_reason("hexi-graphs-8x1", "cpu", None) == module.GRAPHS_ON_CPU
    assert module.skip_reason("hexi-graphs-8x1", "cuda", None) is None
    assert module.skip_reason("megatron-te-1x8", "cuda", "no te") == "no te"
    assert module.skip_reason("megatron-te-1x8", "cuda", None) is None
    assert module.skip_reason("hexi-te_graphs-1x8", "cuda", None) == module.TE_GRAPHS
    assert module.skip_reason("bf16", "cpu", "no te") is None
    # the most important cases come first: graphs, then fusions, then eager, at 1 x 8
    assert module.CASES[:6] == (
        "hexi-graphs-1x8",
        "megatron-graphs-1x8",
        "hexi-fused-1x8",
        "megatron-fused-1x8",
        "hexi-eager-1x8",
        "megatron-eager-1x8",
    )


def test_eager_flags_turn_every_fusion_off():
    """The eager variant's pretrain_gpt.py flags give FusionConfig with every fusion off."""
    spec = importlib.util.spec_from_file_location(
        "gpu_check_train", REPO / "tools" / "bench" / "_gpu_check_train.py"
    )
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    from megatron_hexi.arguments import parse_args, run_config

    required = ["--hetero-plan-path", "p.json", "--train-iters", "3", "--lr", "1e-3", "--mock-data"]
    assert run_config(parse_args(required)).fusions == train.fusion_config(True)
    eager = run_config(parse_args(required + list(train.EAGER_FLAGS))).fusions
    assert eager == train.fusion_config(False)


def test_megatron_case_alone_takes_the_runtimes_fusion_choice(tmp_path):
    """Plain megatron-core's case without the runtime's case of its variant takes the fusions
    the runtime would choose (RoPE's is off without Transformer Engine), not FusionConfig's bare
    defaults: megatron-core refuses `apply_rope_fusion` without TE."""
    spec = importlib.util.spec_from_file_location(
        "gpu_check_train", REPO / "tools" / "bench" / "_gpu_check_train.py"
    )
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    from megatron_hexi.fusions import stage_fusions
    from planner.plan import load_plan
    from planner.transformer_impl import te_installed

    plan = load_plan(REPO / "examples" / "plans" / "hetero-4rank.json")  # its model, training
    record = tmp_path / "fusions.json"
    fused = train.megatron_fusions(record, True, True, plan)
    expected = stage_fusions(
        train.fusion_config(True),
        True,
        plan.model,
        bf16=True,
        transformer_impl=plan.training.transformer_impl,
        holds_output=True,
    )
    assert fused == expected.config_fields()
    assert fused["bias_dropout_fusion"] is True  # needs nothing beyond CUDA
    assert fused["apply_rope_fusion"] is te_installed()
    assert not any(train.megatron_fusions(record, False, True, plan).values())
    assert not any(train.megatron_fusions(record, True, False, plan).values())  # CPU
    record.write_text(json.dumps({"apply_rope_fusion": True}))  # the runtime's record wins
    assert train.megatron_fusions(record, True, True, plan) == {"apply_rope_fusion": True}
