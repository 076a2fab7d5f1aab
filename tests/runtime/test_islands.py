"""Islands (planner.islands) and `--optimizer sgd`, against one-process references.

- SGD with momentum under a heterogeneous plan equals the one-rank plan (as the Adam tests).
- Degenerate islands (H = 1, outer sgd, lr 1, momentum 0, inner SGD, no clipping) are
  synchronous training: equal to the one-rank plan, on islands of different shapes and shards.
- DiLoCo (inner AdamW, outer Nesterov) under an island layout with uneven shards equals the
  one-process reference (tests/runtime/diloco_reference.py), with one fragment and fp32
  exchange, and with two fragments and int8 exchange; breaking the outer step is caught.
- Each rank's cross-island bytes equal planner.outer_traffic's prediction.
Six-rank runs on the CPU: the launches are shared between the checks.
"""

import json

import pytest

from harness import run_distributed
from planner.islands import OuterSettings
from planner.outer_traffic import outer_bytes_per_rank
from planner.plan import load_plan
from runtime.diloco_reference import diloco
from runtime.equivalence import TOLERANCE, compare
from runtime.island_workers import train_islands
from runtime.plans import ISLAND_PIPELINES, ISLANDS, PLANS, REFERENCE, write_plan
from runtime.workers import max_relative_difference, train

SGD_FLAGS = ["--optimizer", "sgd", "--sgd-momentum", "0.9", "--lr", "0.1", "--clip-grad", "0"]
SGD_FLAGS += ["--train-iters", "4"]
DILOCO_FLAGS = ["--train-iters", "4"]
OUTER = {
    "diloco": OuterSettings(interval=2, optimizer="nesterov", lr=0.7, momentum=0.9),
    "streaming": OuterSettings(2, "nesterov", 0.7, 0.9, fragments=2),
    "streaming_int8": OuterSettings(2, "nesterov", 0.7, 0.9, compression="int8", fragments=2),
    "diloco_bf16": OuterSettings(2, "nesterov", 0.7, 0.9, compression="bf16"),
}
# With the distributed optimizer: the outer state is sharded like the masters (named "*_sharded")
SHARDED = {
    "diloco_sharded": "diloco",
    "streaming_sharded": "streaming",
    "streaming_int8_sharded": "streaming_int8",
}


# ISLAND_PIPELINES' islands on other pipelines: island 0 reads the same 6 samples per step on
# one pipeline (a TP=2 stage with uneven shards after a TP=1 one), island 1 its 2 on one rank.
RESHARDED = [
    {
        "micro_batch_size": 3,
        "num_microbatches": 2,
        "stages": [
            {"ranks": [0], "layers": [0, 2]},
            {"ranks": [1, 2], "layers": [2, 4], "shards": {"ffn": [96, 160], "vocab": [40, 88]}},
        ],
    },
    {"micro_batch_size": 2, "num_microbatches": 1, "stages": [{"ranks": [3], "layers": [0, 4]}]},
]


def _params_difference(got, want):
    assert got.keys() == want.keys()
    return max(max_relative_difference(got[k], want[k]) for k in want)


def _losses_difference(got, want):
    return max(max_relative_difference(a, b) for a, b in zip(got, want))


@pytest.fixture(scope="module")
def sgd_reference(tmp_path_factory):
    path = write_plan(tmp_path_factory.mktemp("sgd"), "one-rank", "tiny", 1, REFERENCE)
    return run_distributed(train, 1, path, extra_flags=SGD_FLAGS, timeout=240)[0]


@pytest.mark.parametrize("sharded", [False, True])
def test_sgd_matches_one_rank(sharded, sgd_reference, tmp_path):
    """--optimizer sgd (momentum 0.9, weight decay): the uneven two-pipeline plan equals the
    one-rank plan, with the optimizer state whole or sharded (distributed optimizer)."""
    model, world, pipelines = PLANS["two_pipelines_uneven_tp2"]
    path = write_plan(tmp_path, "sgd", model, world, pipelines, use_distributed_optimizer=sharded)
    result = run_distributed(train, world, path, extra_flags=SGD_FLAGS, timeout=400)[0]
    loss, norm, param = compare(result, sgd_reference)
    print(
        f"sgd (distributed optimizer {sharded}): max relative difference loss {loss:.2e}, "
        f"norm {norm:.2e}, params {param:.2e}"
    )
    assert loss < TOLERANCE and norm < TOLERANCE and param < TOLERANCE
    ref = sgd_reference["losses"]
    assert abs(ref[-1] - ref[0]) > 1e-3  # SGD moved the weights


def test_sgd_resume_matches_uninterrupted(sgd_reference, tmp_path):
    """SGD's momentum buffers are saved and restored (by canonical ranges): a run stopped
    after step 2 and resumed equals the uninterrupted one-rank run."""
    model, world, pipelines = PLANS["two_pipelines_uneven_tp2"]
    path = write_plan(tmp_path, "sgd", model, world, pipelines)
    ckpt = str(tmp_path / "ckpt")
    first = run_distributed(
        train, world, path, extra_flags=[*SGD_FLAGS, "--save", ckpt, "--exit-interval", "2"]
    )[0]
    resumed = run_distributed(train, world, path, extra_flags=[*SGD_FLAGS, "--load", ckpt])[0]
    meta = json.loads((tmp_path / "ckpt" / "iter_0000002" / "checkpoint.json").read_text())
    assert meta["sgd_momentum_state"] and not meta["has_optimizer_state"]
    joined = {
        "losses": first["losses"] + resumed["losses"],
        "grad_norms": first["grad_norms"] + resumed["grad_norms"],
        "params": resumed["params"],
    }
    loss, norm, param = compare(joined, sgd_reference)
    print(f"sgd resumed after step 2: loss {loss:.2e}, norm {norm:.2e}, params {param:.2e}")
    assert len(resumed["losses"]) == 2
    assert loss < TOLERANCE and norm < TOLERANCE and param < TOLERANCE


@pytest.mark.parametrize("overlap, islands", [(False, ISLANDS), (True, ISLANDS), (False, ())])
def test_degenerate_islands_are_synchronous(overlap, islands, sgd_reference, tmp_path):
    """H = 1, outer sgd lr 1 momentum 0: every island lands on the token-weighted average of
    the islands' SGD steps, which (SGD and weight decay being linear) is the synchronous step;
    with the island's gradient sync serial or overlapped with the backward pass, and for a plan
    of one island (the outer step then hands each range to its holders inside it only)."""
    outer = OuterSettings(interval=1, optimizer="sgd", lr=1.0, momentum=0.0)
    path = write_plan(
        tmp_path,
        "degenerate",
        "tiny",
        6,
        ISLAND_PIPELINES,
        islands=islands,
        outer=outer,
        overlap_grad_reduce=overlap,
    )
    result = run_distributed(train_islands, 6, path, extra_flags=SGD_FLAGS, timeout=400)[0]
    loss = _losses_difference(result["losses"], sgd_reference["losses"])
    params = [_params_difference(p, sgd_reference["params"]) for p in result["islands"]]
    print(
        f"degenerate, {len(islands) or 1} island(s), overlap {overlap}: loss {loss:.2e}, "
        f"parameters {params}"
    )
    assert result["outer_step"] == [True] * 4
    assert loss < TOLERANCE and max(params) < TOLERANCE


def test_one_island_checkpoint_starts_every_island(sgd_reference, tmp_path):
    """A synchronous checkpoint (one island, SGD with momentum) loaded under a plan with two
    islands: every island starts from its weights and momentum buffers, the outer step afresh
    (theta_outer = those weights). With the degenerate outer step (H = 1, sgd lr 1, momentum 0)
    the continued run is the synchronous one: steps 3-4 equal the uninterrupted one-rank run.
    An island started from other weights or a fresh momentum, or theta_outer not the loaded
    weights, would move the average off the synchronous step."""
    ckpt = str(tmp_path / "ckpt")
    sync = write_plan(tmp_path, "sync", "tiny", 6, ISLAND_PIPELINES)
    first = run_distributed(
        train, 6, sync, extra_flags=[*SGD_FLAGS, "--save", ckpt, "--exit-interval", "2"]
    )[0]
    outer = OuterSettings(interval=1, optimizer="sgd", lr=1.0, momentum=0.0)
    path = write_plan(tmp_path, "isl", "tiny", 6, ISLAND_PIPELINES, islands=ISLANDS, outer=outer)
    resumed = run_distributed(
        train_islands, 6, path, extra_flags=[*SGD_FLAGS, "--load", ckpt], timeout=400
    )[0]
    meta = json.loads((tmp_path / "ckpt" / "iter_0000002" / "checkpoint.json").read_text())
    assert meta.get("islands", 1) == 1
    loss = _losses_difference(first["losses"] + resumed["losses"], sgd_reference["losses"])
    params = [_params_difference(p, sgd_reference["params"]) for p in resumed["islands"]]
    print(f"one-island checkpoint into two islands: loss {loss:.2e}, parameters {params}")
    assert len(first["losses"]) == 2 and len(resumed["losses"]) == 2
    assert resumed["outer_step"] == [True] * 2
    assert loss < TOLERANCE and max(params) < TOLERANCE


@pytest.fixture(scope="module")
def diloco_runs(tmp_path_factory):
    """The reference for both outer settings, in one launch: {name: (plan path, result)}."""
    d = tmp_path_factory.mktemp("diloco")
    plans = {
        name: write_plan(
            d,
            name,
            "tiny",
            6,
            ISLAND_PIPELINES,
            islands=ISLANDS,
            outer=OUTER[SHARDED.get(name, name)],
            use_distributed_optimizer=name in SHARDED,
        )
        for name in [*OUTER, *SHARDED]
    }
    one = write_plan(d, "one-rank", "tiny", 1, REFERENCE)
    refs = run_distributed(
        diloco, 1, list(plans.values()), one, extra_flags=DILOCO_FLAGS, timeout=300
    )[0]
    return {name: (path, ref) for (name, path), ref in zip(plans.items(), refs)}


def _check_against_reference(result, ref):
    loss = _losses_difference(result["losses"], ref["losses"])
    params = [_params_difference(g, w) for g, w in zip(result["islands"], ref["islands"])]
    return loss, params


def _rounding_flips(result, ref):
    """bf16 / int8: (elements beyond TOLERANCE of their tensor's scale, all elements, the largest
    absolute difference among them). Quantisation is discontinuous: where a value sits within
    float noise (~1e-7 of the inner steps' sums in another order) of a rounding midpoint, the
    two runs round it to neighbouring steps; every other element must match."""
    off, total, worst = 0, 0, 0.0
    for got, want in zip(result["islands"], ref["islands"]):
        for k, w in want.items():
            diff = (got[k] - w).abs()
            bad = diff > TOLERANCE * w.abs().max()
            off += int(bad.sum())
            total += w.numel()
            worst = max(worst, float(diff.max()))
    return off, total, worst


@pytest.mark.parametrize("name", [*OUTER, *SHARDED])
def test_islands_match_reference_diloco(name, diloco_runs):
    """Inner AdamW with clipping per island, outer Nesterov (lr 0.7, momentum 0.9) every 2
    steps, one fragment or two (staggered), fp32, bf16 or int8 exchange: losses and each island's
    final parameters equal the reference; each rank's bytes sent across islands per outer
    cycle equal planner.outer_traffic's prediction."""
    path, ref = diloco_runs[name]
    plan = load_plan(path)
    result = run_distributed(train_islands, 6, path, extra_flags=DILOCO_FLAGS, timeout=400)[0]
    loss, params = _check_against_reference(result, ref)
    outer = plan.training.outer
    cycle = [
        sum(per_rank)
        for per_rank in zip(*result["outer_sync_bytes"][outer.interval : 2 * outer.interval])
    ]
    predicted = outer_bytes_per_rank(plan)
    print(
        f"{name}: loss {loss:.2e}, parameters per island {params}; outer steps "
        f"{result['outer_step']}; bytes per rank per cycle {cycle}, predicted {predicted}"
    )
    assert loss < TOLERANCE
    if outer.compression != "none":
        off, total, worst = _rounding_flips(result, ref)
        quantum = ref["rounding_quantum"]
        print(
            f"{name}: {off} of {total} elements differ by more than {TOLERANCE:g}, by at most "
            f"{worst:.2e}; one {outer.compression} step moves theta by up to {quantum:.2e}"
        )
        assert off < 1e-2 * total and worst <= 2 * quantum
    else:
        assert max(params) < TOLERANCE
    assert cycle == predicted
    # unsharded, pipeline 1 represents nothing (pipeline 0 sends for island 0); sharded, every
    # rank sends the ranges of its own master parts
    if name in SHARDED:
        assert min(predicted) > 0
    else:
        assert predicted[3] == 0 and min(predicted[r] for r in (0, 1, 2, 4, 5)) > 0
    if outer.fragments == 1:
        assert result["outer_step"] == [False, True, False, True]
    else:  # fragment 1 after steps 1 and 3, fragment 0 after steps 2 and 4
        assert result["outer_step"] == [1, 0, 1, 0]
        # the fragment that landed before step 4's update was then updated per island
        assert _params_difference(ref["islands"][0], ref["islands"][1]) > 100 * TOLERANCE


@pytest.mark.parametrize("defect", ["equal_weights", "momentum_dropped"])
def test_broken_outer_step_is_caught(defect, diloco_runs):
    path, ref = diloco_runs["diloco"]
    result = run_distributed(
        train_islands, 6, path, extra_flags=DILOCO_FLAGS, defect=defect, timeout=400
    )[0]
    loss, params = _check_against_reference(result, ref)
    print(f"{defect}: loss {loss:.2e}, parameters per island {params}")
    assert max(params) > 100 * TOLERANCE, f"{defect} was not detected"


def test_resume_mid_interval_matches_uninterrupted(diloco_runs, tmp_path):
    """Two fragments, a checkpoint after step 3 (H = 2: fragment 1's outer step is in flight),
    resumed for step 4: the same losses and parameters as the uninterrupted reference. The
    checkpoint holds each island's weights and Adam state, theta_outer, the outer momentum and
    the fragment whose result waits to be written."""
    path, ref = diloco_runs["streaming"]
    save = ["--save", str(tmp_path / "ckpt")]
    first = run_distributed(
        train_islands,
        6,
        path,
        extra_flags=[*DILOCO_FLAGS, *save, "--exit-interval", "3"],
        timeout=400,
    )[0]
    resumed = run_distributed(
        train_islands,
        6,
        path,
        extra_flags=[*DILOCO_FLAGS, "--load", str(tmp_path / "ckpt")],
        timeout=400,
    )[0]
    meta = json.loads((tmp_path / "ckpt" / "iter_0000003" / "checkpoint.json").read_text())
    kinds = {row["kind"] for rows in meta["files"].values() for row in rows}
    assert meta["islands"] == 2 and meta["outer_landed"] == [1]
    assert {"outer_param", "outer_momentum", "island1.param", "island1.exp_avg"} <= kinds
    # the same islands under other pipelines and shards (same samples per island): the state
    # is read back by canonical ranges
    resharded = write_plan(
        tmp_path, "resharded", "tiny", 4, RESHARDED, islands=[[0], [1]], outer=OUTER["streaming"]
    )
    again = run_distributed(
        train_islands,
        4,
        resharded,
        extra_flags=[*DILOCO_FLAGS, "--load", str(tmp_path / "ckpt")],
        timeout=400,
    )[0]
    # the same plan with the distributed optimizer: the outer state goes into master parts
    sharded = run_distributed(
        train_islands,
        6,
        diloco_runs["streaming_sharded"][0],
        extra_flags=[*DILOCO_FLAGS, "--load", str(tmp_path / "ckpt")],
        timeout=400,
    )[0]
    runs = (("same plan", resumed), ("resharded", again), ("distributed optimizer", sharded))
    for what, run in runs:
        joined = {"losses": first["losses"] + run["losses"], "islands": run["islands"]}
        loss, params = _check_against_reference(joined, ref)
        print(f"resumed after step 3, {what}: loss {loss:.2e}, parameters per island {params}")
        assert len(first["losses"]) == 3 and len(run["losses"]) == 1
        assert loss < TOLERANCE and max(params) < TOLERANCE


def test_refusals_and_log_line(tmp_path):
    """What islands do not run with yet is refused in one line, before any process starts; the
    iteration line says when an outer step ran."""
    from megatron_hexi.arguments import OUTER_SHARDED_NEEDS_RANK_SET_BUCKETS, check_command_line
    from megatron_hexi.metrics import IntervalLog
    from planner.errors import SpecError

    base = ["--mock-data", "--lr", "1e-3", "--train-iters", "4"]
    sharded = write_plan(
        tmp_path,
        "sharded",
        "tiny",
        6,
        ISLAND_PIPELINES,
        islands=ISLANDS,
        outer=OUTER["diloco"],
        use_distributed_optimizer=True,
    )
    check_command_line(["--hetero-plan-path", str(sharded), *base])
    with pytest.raises(SpecError) as e:
        check_command_line(["--hetero-plan-path", str(sharded), *base, "--ddp-bucket-size", "512"])
    assert e.value.problems == [OUTER_SHARDED_NEEDS_RANK_SET_BUCKETS]

    plan = load_plan(write_plan(tmp_path, "isl", "tiny", 6, ISLAND_PIPELINES, islands=ISLANDS))
    log = IntervalLog(plan, 4, 1.0, False)
    row = {
        "success": True,
        "lm_loss": 5.0,
        "step_time_s": 0.5,
        "tokens_per_s": 1.0,
        "mfu": 0.1,
        "lr": 1e-3,
        "grad_norm": 1.0,
        "grad_sync_exposed_s": 0.0,
        "outer_sync_exposed_s": 0.002,
    }
    for it, ran, sent in ((1, False, [0] * 6), (2, True, [100, 0, 0, 0, 5000, 0])):
        log.add({**row, "iteration": it, "outer_step": ran, "outer_sync_bytes": sent})
    line = log.line()
    assert "outer steps: 1 (last after iteration 2) | outer sync MB per rank (max): 0.005" in line
    assert "outer sync exposed (ms): 4.0" in line
