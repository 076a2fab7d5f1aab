"""--fp16 with megatron-core's loss scaling, under a heterogeneous plan, against one rank in fp16.

The fixture makes two launches: one rank (the reference, and other models' layers in fp16 and
fp32), and 4 ranks (two pipelines of different depth, an uneven TP=2 stage) training several runs
in turn (runtime.fp16_workers); the per-pipeline defect has a launch of its own. Steps are
skipped by an inf put into one rank's gradient at iterations 2, 3 and 5 (on the reference: its
only rank), so the loss scale goes 256, 256, 128 (halved after two overflows: hysteresis 2), 128,
64, 64 and back to 128 (doubled after two clean steps: window 2), on every rank alike.
"""

import json
import math

import pytest

from harness import DistributedTestError, run_distributed
from megatron_hexi.arguments import parse_args
from megatron_hexi.metrics import IntervalLog
from planner.errors import SpecError
from planner.plan import load_plan
from runtime.fp16_workers import FP16_FLAGS, train_fp16_runs
from runtime.plans import PLANS, REFERENCE, write_plan
from runtime.workers import max_relative_difference

SKIPPED = [2, 3, 5]  # iterations whose gradients hold the put-in inf
SCALES = [256.0, 256.0, 128.0, 128.0, 64.0, 64.0, 128.0]  # after each iteration's update
# fp16 against fp16 on one rank: both round every activation and weight to an 11-bit mantissa
# (relative step 2^-11 = 4.9e-4), but sum in other orders (uneven TP shards, micro-batches of 1
# and 2 samples, the pipelines' gradients summed in fp32). Measured on this plan, 7 steps (4
# taken): loss 4.9e-6, grad norm 2.1e-5 (distributed optimizer 3.3e-5), parameters 1.5e-3. The
# parameters compared are the fp16 weights: near 1 (norm weights) one fp16 step is 2^-10 =
# 9.8e-4, so 1.5e-3 is a weight rounded one or two steps apart from fp32 masters that differ in
# their last bits. Bounds: 10-20x the measured loss and norm, 3 fp16 steps for parameters. A
# defect gives more: a gradient left scaled is off by 256x in the norm, and one step taken by
# some ranks and skipped by others moves weights of 0.02-0.06 by lr = 1e-3 (over 1.6e-2).
LOSS, NORM, PARAM = 1e-4, 5e-4, 3e-3


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("fp16")
    model, world, pipelines = PLANS["two_pipelines_uneven_tp2"]
    # the reference, then the layers of other models in fp16 and fp32 on one CPU rank: tied
    # embeddings with torch's fused attention (SDPA), and grouped-query attention
    others = [
        {
            "plan": write_plan(d, f"{m}-{backend}", m, 1, REFERENCE, attention_backend=backend),
            "flags": flags,
        }
        for m, backend in (("tiny-tied", "auto"), ("tiny-gqa", "unfused"))
        for flags in (["--fp16", "--initial-loss-scale", "256"], [])
    ]
    one_rank = [
        {
            "plan": write_plan(d, "one", model, 1, REFERENCE),
            "flags": FP16_FLAGS,
            "inject": (0, SKIPPED),
        },
        *others,
    ]
    ref, *layers = run_distributed(train_fp16_runs, 1, one_rank, timeout=240)[0]
    plan = write_plan(d, "plan", model, world, pipelines)
    distributed = write_plan(
        d, "distributed", model, world, pipelines, use_distributed_optimizer=True
    )
    overlapped = write_plan(
        d,
        "overlapped",
        model,
        world,
        pipelines,
        use_distributed_optimizer=True,
        optimizer_shard="memory",
        overlap_grad_reduce=True,
        overlap_param_gather=True,
    )
    ckpt = d / "ckpt"
    specs = {
        # rank 1: TP rank 1 of pipeline 0's first stage; its inf reaches ranks 1 and 3 only
        "plan": {
            "plan": plan,
            "flags": FP16_FLAGS + ["--save", str(ckpt), "--save-interval", "3"],
            "inject": (1, SKIPPED),
        },
        "resumed": {
            "plan": plan,
            "flags": FP16_FLAGS + ["--load", str(ckpt), "--ckpt-step", "3"],
            "inject": (1, SKIPPED),
        },
        # the inf reaches one master part's owner alone
        "distributed": {"plan": distributed, "flags": FP16_FLAGS, "inject": (1, SKIPPED)},
        # the same with small buckets reduced during the backward and parameters gathered
        # during the next forward
        "overlapped": {
            "plan": overlapped,
            "flags": FP16_FLAGS + ["--ddp-bucket-size", "1000"],
            "inject": (1, SKIPPED),
        },
        # a genuine overflow: the label logits' gradient, about -2^18 or more, is inf in fp16
        "overflow": {
            "plan": plan,
            "flags": ["--fp16", "--initial-loss-scale", str(2**20), "--train-iters", "3"],
            "initial": True,
        },
        "no_unscale": {"plan": plan, "flags": FP16_FLAGS, "inject": (1, SKIPPED)},
        # Megatron-LM's bf16 with a constant --loss-scale: scaled, and skipped on an inf too
        "bf16_constant": {
            "plan": distributed,
            "flags": ["--bf16", "--loss-scale", "1024"],
            "inject": (1, [2]),
        },
    }
    specs["no_unscale"]["defect"] = "no_unscale"
    results = run_distributed(train_fp16_runs, world, list(specs.values()), timeout=600)[0]
    meta = json.loads((ckpt / "iter_0000003" / "checkpoint.json").read_text())
    return ref, dict(zip(specs, results)), meta, layers


def differences(result, ref, first=0):
    """Largest relative differences (losses, grad norms of the steps taken, parameters) against
    the reference's iterations from `first` on."""
    loss = max(
        max_relative_difference(a, b) for a, b in zip(result["losses"], ref["losses"][first:])
    )
    norms = [(a, b) for a, b in zip(result["grad_norms"], ref["grad_norms"][first:]) if b]
    norm = max(max_relative_difference(a, b) for a, b in norms)
    param = max(
        max_relative_difference(result["params"][k], ref["params"][k]) for k in ref["params"]
    )
    return loss, norm, param


def assert_agreed(result, skipped, iterations):
    """Every rank skipped exactly the `skipped` iterations, and holds the same scaler state;
    the lr schedule and Adam moved once per step taken."""
    taken = len(iterations) - len([i for i in iterations if i in skipped])
    for r in result["ranks"]:
        assert r["success"] == [i not in skipped for i in iterations], r
        assert r["scheduler_steps"] == (r["adam_steps"][-1] if r["adam_steps"] else 0)
        assert r["scaler"] == result["ranks"][0]["scaler"]
    assert result["ranks"][0]["scheduler_steps"] >= taken
    skipped_norms = [n for i, n in zip(iterations, result["grad_norms"]) if i in skipped]
    assert skipped_norms == [None] * len(skipped_norms)


def test_fp16_plan_matches_one_rank_fp16(runs):
    ref, got, *_ = runs
    assert ref["iterations"] == list(range(1, 8)) and ref["dtype"] == "torch.float16"
    assert ref["loss_scales"] == SCALES
    assert_agreed(ref, SKIPPED, ref["iterations"])
    for name in ("plan", "distributed", "overlapped"):
        result = got[name]
        loss, norm, param = differences(result, ref)
        print(f"fp16 {name}: loss {loss:.2e}, grad norm {norm:.2e}, parameters {param:.2e}")
        assert result["loss_scales"] == SCALES
        assert_agreed(result, SKIPPED, result["iterations"])
        assert result["ranks"][0]["scheduler_steps"] == 4  # 7 iterations, 3 skipped
        # the agreement over the world is what skipped them: at each, some ranks' own
        # gradients were finite
        for i in SKIPPED:
            local = [r["local_inf"][i - 1] for r in result["ranks"]]
            print(f"fp16 {name}: iteration {i}, ranks whose own gradients held the inf: {local}")
            assert any(local) and not all(local)
        assert loss < LOSS and norm < NORM and param < PARAM
    # training moved the weights well beyond the tolerance
    first, last = ref["losses"][0], ref["losses"][-1]
    assert abs(last - first) / first > 10 * LOSS


def test_overflow_is_skipped_on_every_rank(runs):
    """A huge initial scale: every step overflows and is skipped everywhere; the scale halves
    after two of them (hysteresis) and at every one after; the weights, Adam and the lr
    schedule stay where they started, while the iterations count on."""
    _, got, *_ = runs
    result = got["overflow"]
    assert result["iterations"] == [1, 2, 3]
    assert result["loss_scales"] == [2.0**20, 2.0**19, 2.0**18]
    assert_agreed(result, [1, 2, 3], result["iterations"])
    for r in result["ranks"]:
        assert r["scheduler_steps"] == 0 and r["adam_steps"] == []
        assert r["scaler"] == {"scale": 2.0**18, "growth_tracker": 0, "hysteresis_tracker": -1}
    changed = [k for k, v in result["params"].items() if not v.equal(result["initial"][k])]
    assert not changed, changed
    assert all(math.isfinite(x) for x in result["losses"])


def test_scaler_state_resumes(runs):
    """Saved after iteration 3 (scale 128, both trackers at 0) and resumed: iterations 4-7
    equal the uninterrupted run's, loss scales included (a fresh scaler would give 256, 256,
    256, 512)."""
    _, got, meta, _ = runs
    assert meta["grad_scaler"] == {"scale": 128.0, "growth_tracker": 0, "hysteresis_tracker": 0}
    straight, resumed = got["plan"], got["resumed"]
    assert resumed["iterations"] == [4, 5, 6, 7]
    assert resumed["loss_scales"] == straight["loss_scales"][3:]
    assert resumed["losses"] == straight["losses"][3:]
    assert resumed["grad_norms"] == straight["grad_norms"][3:]
    assert all(resumed["params"][k].equal(v) for k, v in straight["params"].items())
    for a, b in zip(resumed["ranks"], straight["ranks"]):
        assert a["scaler"] == b["scaler"] and a["success"] == b["success"][3:]


def test_constant_loss_scale_skips_too(runs):
    """--bf16 --loss-scale 1024 (megatron-core's constant scaler) under the distributed
    optimizer: the scale never moves, the inf's step is skipped everywhere all the same."""
    _, got, *_ = runs
    result = got["bf16_constant"]
    assert result["loss_scales"] == [1024.0] * 3 and result["dtype"] == "torch.bfloat16"
    assert_agreed(result, [2], result["iterations"])
    assert result["ranks"][0]["scaler"] == {"scale": 1024.0}


def test_fp16_layers_on_cpu_match_fp32(runs):
    """megatron-core's layers in fp16 on the CPU (torch's fp16 matmul, norms, softmax, SDPA):
    the same losses and grad norms as fp32, to fp16 precision (measured: loss 1.8e-6 and
    6.4e-6, grad norm 4.4e-5 and 1.4e-5; bounds 15-20x that)."""
    *_, layers = runs
    for name, (fp16, fp32) in zip(("tiny-tied, SDPA", "tiny-gqa"), zip(layers[::2], layers[1::2])):
        assert fp16["dtype"] == "torch.float16" and fp32["dtype"] == "torch.float32"
        assert_agreed(fp16, [], fp16["iterations"])
        loss = max(max_relative_difference(a, b) for a, b in zip(fp16["losses"], fp32["losses"]))
        norm = max(
            max_relative_difference(a, b) for a, b in zip(fp16["grad_norms"], fp32["grad_norms"])
        )
        print(f"{name}: fp16 against fp32, loss {loss:.2e}, grad norm {norm:.2e}")
        assert loss < 1e-4 and norm < 1e-3


def test_gradients_left_scaled_are_caught(runs):
    """The defect: gradients not divided by the scale before clipping. The comparison sees the
    grad norm 256x too large."""
    ref, got, *_ = runs
    loss, norm, param = differences(got["no_unscale"], ref)
    print(f"no_unscale: loss {loss:.2e}, grad norm {norm:.2e}, parameters {param:.2e}")
    assert norm > 100 * NORM


def test_found_inf_agreed_per_pipeline_is_caught(tmp_path):
    """The defect: the found-inf flag agreed over each pipeline (what megatron-core's
    model-parallel group is), under the distributed optimizer. Rank 1's inf reaches its master
    part's owner alone (rank 1, above), so pipeline 0 skips iteration 2 and pipeline 1 steps:
    the ranks then disagree on the step's collectives (the norm's all-reduce on one side only),
    which gloo refuses and NCCL would hang in. The run must fail; it never gives numbers."""
    model, world, pipelines = PLANS["two_pipelines_uneven_tp2"]
    spec = {
        "plan": write_plan(
            tmp_path, "distributed", model, world, pipelines, use_distributed_optimizer=True
        ),
        "flags": FP16_FLAGS,
        "inject": (1, SKIPPED),
        "defect": "pipeline_found_inf",
    }
    with pytest.raises(DistributedTestError) as failed:
        run_distributed(train_fp16_runs, world, [spec], timeout=240)
    assert "train_step" in str(failed.value)  # in a training step, not in setting it up


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--fp16", "--bf16"], "--fp16 and --bf16 exclude each other: give one of them"),
        (["--fp16", "--hysteresis", "0"], "--hysteresis must be >= 1, got 0"),
        (["--fp16", "--loss-scale-window", "2.5"], "--loss-scale-window must be a whole number"),
        (["--fp16", "--loss-scale", "0"], "--loss-scale must be > 0, got 0.0"),
        (["--fp16", "--min-loss-scale", "8", "--initial-loss-scale", "4"], "is above"),
        (["--loss-scale", "8"], "--loss-scale needs --fp16 or --bf16"),
    ],
)
def test_precision_flag_errors(flags, message):
    base = ["--hetero-plan-path", "p.json", "--mock-data", "--train-iters", "3", "--lr", "1e-3"]
    with pytest.raises(SpecError) as e:
        parse_args(base + flags)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_iteration_line_counts_skipped_steps(tmp_path):
    """Megatron-LM's line: the loss scale after the last step, the loss averaged over the steps
    taken, no grad norm after a skipped step, and the skipped ones counted."""
    model, world, pipelines = PLANS["two_pipelines_uneven_tp2"]
    plan = load_plan(write_plan(tmp_path, "plan", model, world, pipelines))
    log = IntervalLog(plan, 10, 1.0, False)
    row = {"step_time_s": 1.0, "tokens_per_s": 1.0, "mfu": 0.1, "lr": 1e-3}
    log.add({**row, "iteration": 1, "success": True, "lm_loss": 4.0, "grad_norm": 2.0})
    log.add(
        {
            **row,
            "iteration": 2,
            "success": False,
            "lm_loss": 9.0,
            "grad_norm": None,
            "loss_scale": 128.0,
        }
    )
    line = log.line()
    assert "lm loss: 4.000000E+00 | loss scale: 128.0 | number of skipped iterations:   1" in line
    assert "grad norm" not in line
