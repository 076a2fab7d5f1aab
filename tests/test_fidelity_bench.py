"""tools/bench/fidelity.py keeps the least disturbed of its profile passes: the one whose one-rank
steps ran fastest, whichever pass it was, and the first where no pass measured them. The bench
itself (minutes of training) is not run here."""

import importlib.util
import json
import sys

from conftest import REPO


def _bench(monkeypatch):
    """The bench module, its own sys.path additions undone after the test."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    spec = importlib.util.spec_from_file_location(
        "fidelity_bench", REPO / "tools" / "bench" / "fidelity.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _profiles(tmp_path, steps):
    """Profile files whose `runtime.points` hold these one-rank steps (None: no runtime entry)."""
    paths = []
    for i, pts in enumerate(steps):
        data = {"matmul_tflops": 0.1}
        if pts is not None:
            data["runtime"] = {
                "points": [{"microbatches": 2**j, "step_s": s} for j, s in enumerate(pts)]
            }
        paths.append(tmp_path / f"profile-{i + 1}.json")
        paths[-1].write_text(json.dumps(data))
    return paths


def test_the_fastest_pass_is_kept(monkeypatch, tmp_path, capsys):
    bench = _bench(monkeypatch)
    paths = _profiles(tmp_path, [[0.30, 0.50], [0.25, 0.45], None, [0.26, 0.50]])
    assert bench.one_rank_seconds(paths[1]) == 0.25 + 0.45
    assert bench.one_rank_seconds(paths[2]) is None
    assert bench.least_disturbed(paths) == paths[1]
    out = capsys.readouterr().out
    assert "profile pass 1: one-rank steps 800.0 ms" in out
    assert "profile pass 3: one-rank steps -" in out
    assert "kept profile pass 2" in out
    # the order of the passes does not decide: first, last or between
    assert bench.least_disturbed([paths[1], paths[0]]) == paths[1]
    assert bench.least_disturbed([paths[0], paths[3], paths[1]]) == paths[1]
    assert bench.least_disturbed([paths[0], paths[3]]) == paths[3]


def test_without_one_rank_steps_the_first_pass_is_kept(monkeypatch, tmp_path):
    bench = _bench(monkeypatch)
    paths = _profiles(tmp_path, [None, None])
    assert bench.least_disturbed(paths) == paths[0]
