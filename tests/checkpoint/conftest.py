"""The checkpoint every test of this folder reads or copies, trained once."""

import pytest

from checkpoint.workers import train
from harness import run_distributed
from runtime.plans import PLANS, write_plan

ITERS = ["--train-iters", "4"]


@pytest.fixture(scope="package")
def straight(tmp_path_factory):
    """Plan A (two pipelines, a TP=2 stage with uneven shards), 4 iterations straight, saving
    every 2 (iter_0000002, iter_0000004), with TensorBoard scalars: (directory, plan, result)."""
    d = tmp_path_factory.mktemp("straight")
    model, world, pipelines = PLANS["two_pipelines_uneven_tp2"]
    plan = write_plan(d, "plan_a", model, world, pipelines)
    result = run_distributed(
        train,
        world,
        plan,
        [
            *ITERS,
            "--save",
            str(d / "ckpt"),
            "--save-interval",
            "2",
            "--tensorboard-dir",
            str(d / "tb"),
        ],
        timeout=300,
    )[0]
    return d, plan, result
