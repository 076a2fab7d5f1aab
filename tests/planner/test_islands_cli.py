"""`hexi-plan manual --islands` and the --outer-* flags; `show` and `simulate` of islands."""

import json

import pytest

from planner.islands import OuterSettings
from planner.plan import load_plan

PIPELINES = [
    {"micro_batch_size": 1, "num_microbatches": 4, "stages": [{"ranks": [0, 1], "layers": [0, 4]}]},
    {"micro_batch_size": 1, "num_microbatches": 4,
     "stages": [{"ranks": [2], "layers": [0, 2]}, {"ranks": [3], "layers": [2, 4]}]},
]  # fmt: skip


@pytest.fixture()
def manual(tmp_path, examples_dir, hexi_plan):
    pipes = tmp_path / "pipes.json"
    pipes.write_text(json.dumps(PIPELINES))

    def run(islands, *flags):
        args = ["manual", "--cluster", examples_dir / "clusters" / "two-site-mini.yaml"]
        args += ["--model", "tiny", "--global-batch-size", "8", "--pipelines", pipes]
        if islands is not None:
            path = tmp_path / "islands.json"
            path.write_text(islands if isinstance(islands, str) else json.dumps(islands))
            args += ["--islands", path]
        return hexi_plan(*args, *flags, "-o", tmp_path / "plan.json")

    return run


def test_manual_islands_and_outer_flags(manual, tmp_path, hexi_plan):
    code, out, err = manual(
        [[1], [0]], "--outer-interval", "16", "--outer-optimizer", "sgd", "--outer-lr", "1",
        "--outer-momentum", "0", "--outer-compression", "bf16", "--outer-fragments", "2",
    )  # fmt: skip
    assert (code, err) == (0, "")
    plan = load_plan(tmp_path / "plan.json")
    assert plan.islands == ((1,), (0,))
    assert plan.training.outer == OuterSettings(16, "sgd", 1.0, 0.0, "bf16", 2)
    code, out, err = hexi_plan("validate", tmp_path / "plan.json")
    assert code == 0 and out.rstrip().endswith(
        "; outer step: every 16 steps, sgd lr 1 momentum 0, compression bf16, 2 fragment(s)"
    )
    code, out, err = hexi_plan("show", tmp_path / "plan.json")
    assert code == 0
    assert (
        "islands: 2 (0: pipelines [1], 4 samples, site west; 1: pipelines [0], 4 samples, "
        "site east)"
    ) in out
    assert "outer step: every 16 steps, sgd lr 1 momentum 0, compression bf16, 2 fragment(s)" in out
    code, out, err = hexi_plan("simulate", tmp_path / "plan.json")
    assert code == 0 and "+ outer sync" in out and "MB across sites per step" in out
    code, out, err = hexi_plan("simulate", "--json", tmp_path / "plan.json")
    est = json.loads(out)
    assert est["cross_site_bytes_per_step"] > 0 and est["inner_step_time_s"] > 0


@pytest.mark.parametrize(
    ("islands", "flags", "line"),
    [
        ([[0], [1]], [], "--islands: islands meet only at outer steps; give --outer-interval"),
        (None, ["--outer-lr", "0.5"], "--outer-lr: needs --outer-interval"),
        ([[0], [1]], ["--outer-interval", "0"], "--outer-interval: must be a positive integer"),
        ([[0], [1]], ["--outer-interval", "2.5"], "--outer-interval: must be an integer"),
        ([[0], [1]], ["--outer-interval", "4", "--outer-momentum", "1"], "--outer-momentum:"),
        ([[0], [1]], ["--outer-interval", "4", "--outer-lr", "nan"], "--outer-lr:"),
        ([[0], [1]], ["--outer-interval", "4", "--outer-optimizer", "adam"],
         "--outer-optimizer: must be one of sgd, nesterov"),
        ([[0], [1]], ["--outer-interval", "4", "--outer-compression", "zip"],
         "--outer-compression: must be one of none, bf16, int8"),
        ([[0], [1]], ["--outer-interval", "4", "--outer-fragments", "5"],
         "--outer-fragments: 5 fragments, but the model has only 4 layers"),
        ([[0, 1], [1]], ["--outer-interval", "4"], "--islands: islands[1].pipelines: pipeline 1"),
        ([[0]], ["--outer-interval", "4"], "--islands: islands: pipelines 1 are in no island"),
        ([[0], [7]], ["--outer-interval", "4"], "--islands: islands[1].pipelines: 7 is not"),
        ({"a": 1}, ["--outer-interval", "4"], "must hold a JSON list of pipeline-index lists"),
        ("[[0], [1]", ["--outer-interval", "4"], "not valid JSON"),
    ],
)  # fmt: skip
def test_manual_bad_islands_input_is_one_line(manual, islands, flags, line):
    code, out, err = manual(islands, *flags)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and line in err, err


def test_picture_names_islands_and_outer_sync(manual, tmp_path):
    from planner.picture import plan_figure
    from planner.simulator import simulate

    assert manual([[0], [1]], "--outer-interval", "10")[0] == 0
    plan = load_plan(tmp_path / "plan.json")
    fig = plan_figure(plan)
    title = fig.axes[0].get_title(loc="left")
    est = simulate(plan)
    assert "2 islands, outer step every 10 steps (nesterov, none, 1 fragment)" in title
    assert f"outer sync {est.outer_sync_time_s:.3g} s/step" in title
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels[0].startswith("I0 P0") and labels[1].startswith("I1 P1")


def test_estimate_fields_of_islands_are_checked(manual, tmp_path):
    from planner.plan_validation import validate_plan_dict

    assert manual([[0], [1]], "--outer-interval", "10")[0] == 0
    data = json.loads((tmp_path / "plan.json").read_text())
    data["estimate"] = {"outer_sync_time_s": -1.0, "island_step_time_s": ["fast"]}
    problems = validate_plan_dict(data)
    assert any(p.startswith("estimate.outer_sync_time_s: must be a number >= 0") for p in problems)
    assert any(
        p.startswith("estimate.island_step_time_s: must be a list of numbers") for p in problems
    )
