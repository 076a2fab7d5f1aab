"""The search is never beaten by a plan it finds for a neighbouring setting: for every example
cluster, llama2-7b and llama2-13b (global batch 64, micro-batch 1, the settings `hexi-plan plan`
uses on GPUs), the plan searched with sequence parallelism on / off, or with the distributed
optimizer on / off, takes at most 1.001 x the time of the plan searched with that toggle flipped,
re-costed under the requested setting (where that plan is valid and fits there).

The case that broke it: paper-hetero-b, llama2-7b: the plan searched with sequence parallelism
took 3.941 s per step, the plan searched without it, re-costed with it, 3.919 s. The partition
that wins without sequence parallelism ranked below the finalists with it; the search now also
lays out its candidate partitions in each neighbouring setting's context (planner.neighbours).

Link speeds are neighbours too: the plan searched for the cluster with every link between
machines half or twice as fast (planner.neighbours.scaled_links), re-costed on the cluster, makes
at most 1.001x the searched plan's tokens/s there, and the reverse. With the finalists' partitions
laid out only at half and twice the speed, 4 of the 64 comparisons missed: mixed-lab llama2-7b
asked at half speed (43,957 tokens/s against 48,201 for the full-speed plan: 0.912), mixed-lab
llama2-13b at twice the speed (0.978), paper-hetero-a llama2-7b at twice the speed (0.985) and
paper-hetero-b llama2-7b at full speed against its twice-speed plan (0.987). The default run
checks those four; the whole matrix is `long` (about 2 CPU minutes more). The toggles are
checked for llama2-7b by default and for llama2-13b under `long` too.
"""

from pathlib import Path

import pytest

from conftest import REPO
from planner import neighbours as neighbours_module
from planner.attention import CLI_DEFAULT_BACKEND
from planner.cluster import load_cluster
from planner.errors import SpecError
from planner.models import load_model
from planner.neighbours import scaled_links
from planner.plan import plan_from_dict
from planner.search import overlap_by_default, search_plan
from planner.simulator import simulate

CLUSTERS = sorted(p.stem for p in Path(REPO, "examples", "clusters").glob("*.yaml"))
MODELS = ("llama2-7b", "llama2-13b")
BASE = (False, False)  # (sequence parallel, distributed optimizer)
TOGGLED = {"sequence_parallel": (True, False), "distributed_optimizer": (False, True)}
_plans: dict[tuple[str, str, tuple[bool, bool], float], object] = {}


def example_cluster(cluster_name, link_scale=1.0):
    """An example cluster, with every link between machines `link_scale` times as fast."""
    cluster = load_cluster(str(REPO / "examples" / "clusters" / f"{cluster_name}.yaml"))
    return cluster if link_scale == 1.0 else scaled_links(cluster, link_scale)


def search_example(cluster_name, model_name, setting=BASE, link_scale=1.0):
    """The searched plan, None where nothing fits (not shared)."""
    cluster = example_cluster(cluster_name, link_scale)
    try:
        return search_plan(
            cluster,
            load_model(model_name),
            64,
            micro_batch_size=1,
            overlap_grad_reduce=overlap_by_default(cluster),
            attention_backend=CLI_DEFAULT_BACKEND,
            sequence_parallel=setting[0],
            use_distributed_optimizer=setting[1],
        )
    except SpecError:
        return None


def searched(cluster_name, model_name, setting=BASE, link_scale=1.0):
    """`search_example`, shared between the cases of this module."""
    key = (cluster_name, model_name, setting, link_scale)
    if key not in _plans:
        _plans[key] = search_example(cluster_name, model_name, setting, link_scale)
    return _plans[key]


def recosted(plan, setting, seq_length):
    """The plan's iteration seconds under `setting`, or None where it is invalid or does not
    fit there."""
    data = plan.to_dict()
    data.pop("estimate", None)
    data["training"]["sequence_parallel"] = setting[0]
    data["training"]["use_distributed_optimizer"] = setting[1]
    tps = {len(s["ranks"]) for p in data["pipelines"] for s in p["stages"]}
    if setting[0] and any(t > 1 and seq_length % t for t in tps):
        return None
    est = simulate(plan_from_dict(data))
    return est.iteration_time_s if est.fits_memory else None


# The default run checks llama2-7b on every cluster; llama2-13b is `long` (about 110 CPU
# seconds more; the searches with the distributed optimizer are the dearest).
TOGGLE_MODELS = [pytest.param(m, marks=() if m == MODELS[0] else pytest.mark.long) for m in MODELS]


@pytest.mark.parametrize("asked_on", [True, False], ids=["asked_on", "asked_off"])
@pytest.mark.parametrize("toggle", sorted(TOGGLED))
@pytest.mark.parametrize("model_name", TOGGLE_MODELS)
@pytest.mark.parametrize("cluster_name", CLUSTERS)
def test_searched_plan_beats_the_neighbours_plan(cluster_name, model_name, toggle, asked_on):
    asked, other = (TOGGLED[toggle], BASE) if asked_on else (BASE, TOGGLED[toggle])
    own, theirs = (searched(cluster_name, model_name, s) for s in (asked, other))
    if own is None:
        assert theirs is None or recosted(theirs, asked, load_model(model_name).seq_length) is None
        return
    assert own.estimate["iteration_time_s"] == pytest.approx(
        simulate(own).iteration_time_s, rel=1e-12
    )
    if theirs is None:
        return
    other_time = recosted(theirs, asked, load_model(model_name).seq_length)
    if other_time is not None:
        assert own.estimate["iteration_time_s"] <= 1.001 * other_time, (
            own.estimate["iteration_time_s"],
            other_time,
        )


def test_the_known_miss_is_fixed():
    """paper-hetero-b, llama2-7b with sequence parallelism: at least as fast as the plan searched
    without it, re-costed with it (3.919 s against 3.941 s before)."""
    own = searched("paper-hetero-b", "llama2-7b", (True, False))
    theirs = recosted(
        searched("paper-hetero-b", "llama2-7b", BASE),
        (True, False),
        load_model("llama2-7b").seq_length,
    )
    assert theirs is not None
    assert own.estimate["iteration_time_s"] <= theirs * (1 + 1e-9)
    assert own.estimate["iteration_time_s"] < 3.93


LINK_FACTORS = (0.5, 2.0)
LINK_MISSES = {  # (cluster, model, the speed asked for, the speed of the other search)
    ("mixed-lab", "llama2-7b", 0.5, 1.0),
    ("mixed-lab", "llama2-13b", 2.0, 1.0),
    ("paper-hetero-a", "llama2-7b", 2.0, 1.0),
    ("paper-hetero-b", "llama2-7b", 1.0, 2.0),
}
LINK_CASES = [
    pytest.param(*case, marks=() if case in LINK_MISSES else pytest.mark.long)
    for case in (
        (c, m, *speeds)
        for c in CLUSTERS
        for m in MODELS
        for f in LINK_FACTORS
        for speeds in ((f, 1.0), (1.0, f))
    )
]


def tokens_at(plan, cluster_name, link_scale):
    """The plan's tokens/s on the example cluster with links `link_scale` as fast, or None
    where it does not fit there."""
    data = plan.to_dict()
    data["cluster"] = example_cluster(cluster_name, link_scale).to_dict()
    data.pop("estimate", None)
    est = simulate(plan_from_dict(data))
    return est.tokens_per_s if est.fits_memory else None


def link_ratio(own, theirs, cluster_name, asked):
    """own's tokens/s over theirs re-costed at `asked` (None: nothing to compare)."""
    if own is None:
        assert theirs is None or tokens_at(theirs, cluster_name, asked) is None
        return None
    tokens = own.estimate["tokens_per_s"]
    assert tokens == pytest.approx(simulate(own).tokens_per_s, rel=1e-12)
    other = None if theirs is None else tokens_at(theirs, cluster_name, asked)
    return None if other is None else tokens / other


@pytest.mark.parametrize("cluster_name,model_name,asked,other", LINK_CASES)
def test_searched_plan_beats_the_plan_searched_at_another_link_speed(
    cluster_name, model_name, asked, other
):
    own, theirs = (searched(cluster_name, model_name, BASE, f) for f in (asked, other))
    ratio = link_ratio(own, theirs, cluster_name, asked)
    assert ratio is None or ratio >= 1 / 1.001, ratio


def test_the_check_catches_link_speeds_laid_out_only_one_step_away(monkeypatch):
    """With the finalists laid out only at half and twice the link speed, paper-hetero-b
    llama2-7b misses again against the plan searched at twice the speed (whose layout comes from
    four times the speed): the comparison above would catch it."""
    theirs = searched("paper-hetero-b", "llama2-7b", BASE, 2.0)  # before breaking the search
    monkeypatch.setattr(neighbours_module, "LINK_SCALES", (0.5, 2.0))
    own = search_example("paper-hetero-b", "llama2-7b", BASE, 1.0)
    ratio = link_ratio(own, theirs, "paper-hetero-b", 1.0)
    assert ratio is not None and ratio < 1 / 1.001, ratio


def test_the_check_catches_a_search_without_unsynced_contenders(monkeypatch):
    """Without the pipeline counts whose pipelines alone beat every finalist
    (Searcher._unsynced_contenders), mixed-lab llama2-7b at half the link speed misses again
    against the full-speed plan (0.912): the comparison above would catch it."""
    from planner.searcher import Searcher

    theirs = searched("mixed-lab", "llama2-7b", BASE, 1.0)  # before breaking the search
    monkeypatch.setattr(Searcher, "_unsynced_contenders", lambda self, per_k, finals: [])
    own = search_example("mixed-lab", "llama2-7b", BASE, 0.5)
    ratio = link_ratio(own, theirs, "mixed-lab", 0.5)
    assert ratio is not None and ratio < 1 / 1.001, ratio
