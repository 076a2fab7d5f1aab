"""Sequence parallelism (the plan's training.sequence_parallel): every stage with TP > 1 runs
megatron-core's sequence parallelism, the boundary communicator moves sequence parts between
stages of any two TP degrees, and the norms' partial gradients are summed by the segment sync.
Every plan learns exactly what the one-rank plan learns."""

import dataclasses

import pytest
import torch

from harness import run_distributed
from planner.errors import PlanError
from planner.layout import canonical_shards, gradient_segments
from planner.models import load_model
from planner.plan import load_plan, plan_from_dict
from runtime.equivalence import TOLERANCE, compare, reference
from runtime.plans import PLANS, write_plan
from runtime.workers import max_relative_difference, train_each, train_with_first_grads

# tp_1_2_3_gqa has a TP-3 stage: its sequence must split in three (and in two for the TP-2 one).
GQA_48 = dataclasses.replace(load_model("tiny-gqa"), seq_length=48)


def _check(name, variant, result, ref):
    loss, norm, param = compare(result, ref)
    print(
        f"{name} {variant}: max relative difference loss {loss:.2e}, grad norm {norm:.2e}, "
        f"parameters {param:.2e}; sequence-parallel ranks "
        f"{sorted(r for r, on in result['sequence_parallel'].items() if on)}"
    )
    assert loss < TOLERANCE and norm < TOLERANCE and param < TOLERANCE, (name, variant)


def test_every_four_rank_plan_matches_one_rank(tmp_path, tmp_path_factory):
    """The four-rank equivalence plans with sequence parallelism, one launch: an uneven TP-2
    stage before a TP-1 stage (also with the distributed optimizer, and with full recompute),
    tied embeddings across TP 2 and 1, and a plan with no TP at all (where it changes nothing)."""
    runs = {
        ("two_pipelines_uneven_tp2", "sp"): {},
        ("two_pipelines_uneven_tp2", "sp+distopt"): {"use_distributed_optimizer": True},
        ("two_pipelines_uneven_tp2", "sp+recompute"): {"recompute": True},
        ("tied_embeddings_across_tp", "sp"): {},
        ("single_beside_three_stages", "sp"): {},
    }
    paths = []
    for i, ((name, _), training) in enumerate(runs.items()):
        model, world, pipelines = PLANS[name]
        assert world == 4
        path = write_plan(
            tmp_path, f"{name}-{i}", model, 4, pipelines, sequence_parallel=True, **training
        )
        assert load_plan(path).training.sequence_parallel
        paths.append((path, []))
    results = run_distributed(train_each, 4, paths, timeout=600)[0]
    for (name, variant), result in zip(runs, results):
        _check(name, variant, result, reference(tmp_path_factory, PLANS[name][0]))
        stages = [s for p in PLANS[name][2] for s in p["stages"]]
        split = sorted(r for s in stages if len(s["ranks"]) > 1 for r in s["ranks"])
        assert sorted(r for r, on in result["sequence_parallel"].items() if on) == split


def test_tp_change_between_sequence_parallel_stages(tmp_path, tmp_path_factory):
    """TP 1 -> 2 -> 3 with uneven shards and GQA: the boundary between the TP-2 and TP-3 stages
    moves halves of the sequence into thirds. Also with the distributed optimizer and the
    overlapped gradient sync, whose buckets carry the norms' partial gradients."""
    _, world, pipelines = PLANS["tp_1_2_3_gqa"]
    variants = {
        "sp": {},
        "sp+distopt+overlap": {"use_distributed_optimizer": True, "overlap_grad_reduce": True},
    }
    runs = [
        (
            write_plan(
                tmp_path, f"gqa48-{i}", GQA_48, world, pipelines, sequence_parallel=True, **training
            ),
            [],
        )
        for i, training in enumerate(variants.values())
    ]
    results = run_distributed(train_each, world, runs, timeout=600)[0]
    ref = reference(tmp_path_factory, GQA_48)
    for variant, result in zip(variants, results):
        _check("tp_1_2_3_gqa (seq 48)", variant, result, ref)
        assert result["sequence_parallel"] == {
            0: False,
            1: True,
            2: True,
            3: True,
            4: True,
            5: True,
        }


def test_unsummed_norm_gradients_are_caught(tmp_path, tmp_path_factory):
    """The comparison sees sequence parallelism's norm gradients left unsummed over TP (each TP
    rank holds its sequence part's sum only): the first synced gradient is wrong."""
    model, world, pipelines = PLANS["two_pipelines_uneven_tp2"]
    ref = reference(tmp_path_factory, model)
    path = write_plan(tmp_path, "sp-broken", model, world, pipelines, sequence_parallel=True)
    result = run_distributed(
        train_with_first_grads, world, path, defect="sp_norms_unsummed", timeout=400
    )[0]
    grads = {k: max_relative_difference(result["grads"][k], ref["grads"][k]) for k in ref["grads"]}
    worst = max(grads, key=grads.get)
    print(f"sp_norms_unsummed: first gradient {grads[worst]:.2e} ({worst})")
    assert grads[worst] > 100 * TOLERANCE
    assert "norm" in worst


# -- without launches -----------------------------------------------------------------------


def _plan_dict(tmp_path, name, model, **training):
    _, world, pipelines = PLANS[name]
    return load_plan(write_plan(tmp_path, name, model, world, pipelines, **training)).to_dict()


def test_a_sequence_its_tp_degree_does_not_divide_is_a_plan_error(tmp_path):
    data = _plan_dict(tmp_path, "tp_1_2_3_gqa", "tiny-gqa")  # seq 32, a TP-3 stage
    data["training"]["sequence_parallel"] = True
    with pytest.raises(PlanError) as e:
        plan_from_dict(data)
    assert str(e.value) == (
        "plan: pipelines[0].stages[2].ranks: training.sequence_parallel splits the sequence "
        "evenly over the stage's TP ranks, but seq_length 32 is not divisible by its TP "
        "degree 3"
    )
    data["training"]["sequence_parallel"] = "yes"
    with pytest.raises(PlanError, match="training.sequence_parallel: must be true or false"):
        plan_from_dict(data)


def test_a_plan_without_the_field_means_no_sequence_parallelism(tmp_path):
    data = _plan_dict(tmp_path, "two_pipelines_uneven_tp2", "tiny")
    assert "sequence_parallel" not in data["training"]
    plan = plan_from_dict(data)
    assert not plan.training.sequence_parallel
    assert not any(plan.rank_view(r).sequence_parallel for r in range(plan.world_size))


def test_norm_gradients_have_every_tp_rank_as_contributor(tmp_path):
    """Each TP rank of a sequence-parallel stage contributes its part of a norm's gradient; the
    norm is still counted once in the gradient norm; split tensors are unchanged."""
    data = _plan_dict(tmp_path, "two_pipelines_uneven_tp2", "tiny")
    plain = gradient_segments(plan_from_dict(data))
    data["training"]["sequence_parallel"] = True
    split = gradient_segments(plan_from_dict(data))
    replicated = {s.name for s in canonical_shards(load_model("tiny")) if "norm" in s.name}
    assert replicated
    for a, b in zip(plain, split, strict=True):
        assert (a.name, a.start, a.end, a.members, a.owner) == (
            b.name,
            b.start,
            b.end,
            b.members,
            b.owner,
        )
        in_tp2 = {0, 1} & set(a.ranks)
        if a.name in replicated and in_tp2:
            assert b.contributors == a.contributors | in_tp2 and len(in_tp2) == 2
        else:
            assert b.contributors == a.contributors


@pytest.mark.parametrize("senders, receivers", [(2, 3), (3, 2), (1, 4), (4, 1), (2, 2)])
def test_a_boundary_part_is_a_sequence_part(senders, receivers):
    """Under sequence parallelism TP rank i of a stage holds sequence positions
    [i s/t, (i+1) s/t): the communicator's flat parts must be exactly those."""
    from megatron_hexi.communicator import Boundary

    s, b, h = 12, 2, 5
    x = torch.arange(s * b * h, dtype=torch.float32).view(s, b, h)
    snd, rcv = list(range(senders)), list(range(senders, senders + receivers))
    launch_of = {r: r for r in snd + rcv}
    for side, ranks in (("sender", snd), ("receiver", rcv)):
        for i, me in enumerate(ranks):
            lo, hi = Boundary(snd, rcv, x.numel(), launch_of, me).my_part(side)
            t = len(ranks)
            assert torch.equal(x.reshape(-1)[lo:hi].view(s // t, b, h), x[i * s // t :][: s // t])
