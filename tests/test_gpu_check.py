"""tools/bench/gpu_check.py on CPU: its cases run and pass, and a broken result makes it fail.

The GPU check itself needs a GPU; its logic (planning, launching, reading metrics, checks, the
table, exit codes) is the same with --device cpu and a tiny model, which is what runs here.
"""

import copy
import importlib.util
import json
import subprocess
import sys

import pytest

from conftest import REPO

SCRIPT = REPO / "tools" / "bench" / "gpu_check.py"


def _run(*args, timeout=240):
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


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


def test_missing_megatron_core_is_named(monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_check_module", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
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
    """One CPU run of the sdpa and megatron cases (two one-rank launches, ~6 s each)."""
    out = tmp_path_factory.mktemp("gpu_check_perf")
    r = _run("--device", "cpu", "--cases", "sdpa", "megatron", "--iters", "3", "--out", out)
    return r, out


def test_megatron_case_runs_and_is_compared_with_sdpa(perf_run):
    r, out = perf_run
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith("| megatron | ")]
    assert len(rows) == 1 and "| - |" not in rows[0], rows  # step time, MFU, peak and predictions
    assert "sdpa vs megatron: step-time ratio " in r.stdout
    assert "| megatron: first loss near ln(vocab) | ok |" in r.stdout
    assert "| megatron: loss decreases | ok |" in r.stdout
    result = json.loads((out / "gpu_check.json").read_text())
    assert sorted(result["cases"]) == ["megatron", "sdpa"]
    metrics = result["cases"]["megatron"]["metrics"]
    assert [m["iteration"] for m in metrics] == [1, 2, 3]
    for key in ("lm_loss", "step_time_s", "tokens_per_s", "mfu", "grad_norm"):
        assert all(isinstance(m[key], float) and m[key] > 0 for m in metrics), key
    assert all(len(m["peak_memory_gb"]) == 1 for m in metrics)
    ratio = result["sdpa_vs_megatron"]
    assert ratio["step_time_ratio"] > 0 and ratio["mfu_ratio"] > 0
    assert all(c["ok"] for c in result["checks"])


def test_broken_megatron_case_fails_and_old_results_recheck(perf_run, tmp_path):
    result = json.loads((perf_run[1] / "gpu_check.json").read_text())
    old = copy.deepcopy(result)  # written before the performance preset: the preset's sizes
    del old["config"]["perf"], old["sdpa_vs_megatron"]
    assert _recheck(tmp_path, old).returncode == 0
    broken = copy.deepcopy(result)
    broken["cases"]["megatron"]["metrics"][-1]["lm_loss"] = float("inf")
    r = _recheck(tmp_path, broken)
    assert r.returncode == 1
    assert "| megatron: losses finite | FAIL |" in r.stdout


def test_performance_cases_are_skipped_when_the_model_does_not_fit(monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_check_module", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
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
    assert line.startswith("sdpa and megatron skipped: the planner predicts a peak of 29.2 GB")
    assert module.perf_fits(estimate, "cpu") is None
