"""Validation loss (--eval-interval, --eval-iters, --skip-train) under heterogeneous plans equals
the one-rank plan's, on mock data and on real data (the validation split of --split, and
--valid-data-path).

One launch per plan trains every case in turn (a launch costs 10-20 s on CPU).
"""

import pytest

from data.commands import flags
from harness import run_distributed
from runtime.plans import PLANS, REFERENCE, write_plan
from runtime.workers import BASE_FLAGS, max_relative_difference, train_and_evaluate

TOLERANCE = 1e-5
REAL_FLAGS = [f for f in BASE_FLAGS if f != "--mock-data"]
EVAL = ["--train-iters", "4", "--eval-interval", "2", "--eval-iters", "2"]
# (iteration, end of run) of every evaluation: every 2 iterations, and once more at the end.
EXPECTED = [(2, False), (4, False), (4, True)]


def cases(corpus, tmp_path):
    cache = ["--data-cache-path", str(tmp_path / "cache")]
    a, b = corpus.prefix["a"], corpus.prefix["b"]
    return {
        "mock": BASE_FLAGS + EVAL,
        "real split": REAL_FLAGS + flags(corpus, a, split="80,20,0") + cache + EVAL,
        "real valid-data-path": REAL_FLAGS
        + flags(corpus, a)
        + ["--valid-data-path", b]
        + cache
        + EVAL,
        "skip-train": BASE_FLAGS + ["--skip-train", "--eval-iters", "1"],
        "mock without evaluation": BASE_FLAGS + ["--train-iters", "4"],
    }


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("valid-ref")
    runs = cases(corpus, tmp)
    path = write_plan(tmp, "one", "tiny", 1, REFERENCE)
    return dict(zip(runs, run_distributed(train_and_evaluate, 1, path, list(runs.values()))[0]))


def test_reference_evaluates_as_megatron(reference):
    """When and what the one-rank run evaluates; evaluation leaves training unchanged."""
    for name in ("mock", "real split", "real valid-data-path"):
        evals = reference[name]["evaluations"]
        assert [(it, end) for it, end, _, _ in evals] == EXPECTED, (name, evals)
        # 2 batches of 8 samples of 32 tokens (tiny), every label counted
        assert all(tokens == 2 * 8 * 32 for *_, tokens in evals), evals
        losses = [loss for _, _, loss, _ in evals]
        # each evaluation reads its own batches, and training lowers the loss
        assert len({round(x, 6) for x in losses}) == 3 and losses[1] < losses[0], losses
    assert reference["skip-train"]["losses"] == []
    assert [(it, end) for it, end, *_ in reference["skip-train"]["evaluations"]] == [(0, True)]
    # the validation data is what the flags say: three different losses after the same steps
    finals = {reference[n]["evaluations"][-1][2] for n in ("mock", "real split")}
    finals.add(reference["real valid-data-path"]["evaluations"][-1][2])
    assert len(finals) == 3, finals
    # evaluating draws no random number and changes no weight: training is bit-identical
    assert reference["mock"]["losses"] == reference["mock without evaluation"]["losses"]
    assert reference["mock without evaluation"]["evaluations"] == []


@pytest.mark.parametrize("name", ["two_pipelines_uneven_tp2", "single_beside_three_stages"])
def test_validation_loss_matches_one_rank(name, reference, corpus, tmp_path):
    model, world, pipelines = PLANS[name]
    runs = cases(corpus, tmp_path)
    path = write_plan(tmp_path, name, model, world, pipelines)
    runs["mock, pipelines weighted equally"] = runs["mock"]
    defects = {len(runs) - 1: "pipeline_mean"}
    outputs = run_distributed(
        train_and_evaluate, world, path, list(runs.values()), defects, timeout=400
    )[0]
    result = dict(zip(runs, outputs))
    broken = result.pop("mock, pipelines weighted equally")
    # the comparison catches a validation loss that weighs pipelines equally
    caught = [
        max_relative_difference(e[2], r[2])
        for e, r in zip(broken["evaluations"], reference["mock"]["evaluations"], strict=True)
    ]
    assert min(caught) > TOLERANCE, caught  # deterministic: same seeds, same batches
    worst = 0.0
    for case, got in result.items():
        ref = reference[case]
        assert [e[:2] for e in got["evaluations"]] == [e[:2] for e in ref["evaluations"]], case
        assert [e[3] for e in got["evaluations"]] == [e[3] for e in ref["evaluations"]], case
        for (*_, loss, _), (*_, ref_loss, _) in zip(got["evaluations"], ref["evaluations"]):
            worst = max(worst, max_relative_difference(loss, ref_loss))
        for loss, ref_loss in zip(got["losses"], ref["losses"], strict=True):
            assert max_relative_difference(loss, ref_loss) < TOLERANCE, case
    print(f"{name}: largest relative difference of a validation loss {worst:.2e}")
    assert worst < TOLERANCE
