"""The search is never beaten by a plan it finds for a neighbouring setting: for every example
cluster, llama2-7b and llama2-13b (global batch 64, micro-batch 1, the settings `hexi-plan plan`
uses on GPUs), the plan searched with sequence parallelism on / off, or with the distributed
optimizer on / off, takes at most 1.001 x the time of the plan searched with that toggle flipped,
re-costed under the requested setting (where that plan is valid and fits there).

The case that broke it: paper-hetero-b, llama2-7b: the plan searched with sequence parallelism
took 3.941 s per step, the plan searched without it, re-costed with it, 3.919 s. The partition
that wins without sequence parallelism ranked below the finalists with it; the search now also
lays out its candidate partitions in each neighbouring setting's context (planner.neighbours).
"""

from pathlib import Path

import pytest

from conftest import REPO
from planner.attention import CLI_DEFAULT_BACKEND
from planner.cluster import load_cluster
from planner.errors import SpecError
from planner.models import load_model
from planner.plan import plan_from_dict
from planner.search import overlap_by_default, search_plan
from planner.simulator import simulate

CLUSTERS = sorted(p.stem for p in Path(REPO, "examples", "clusters").glob("*.yaml"))
MODELS = ("llama2-7b", "llama2-13b")
BASE = (False, False)  # (sequence parallel, distributed optimizer)
TOGGLED = {"sequence_parallel": (True, False), "distributed_optimizer": (False, True)}
_plans: dict[tuple[str, str, tuple[bool, bool]], object] = {}


def searched(cluster_name, model_name, setting):
    """The searched plan (None where nothing fits), shared between the cases of this module."""
    key = (cluster_name, model_name, setting)
    if key not in _plans:
        cluster = load_cluster(str(REPO / "examples" / "clusters" / f"{cluster_name}.yaml"))
        try:
            _plans[key] = search_plan(
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
            _plans[key] = None
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


@pytest.mark.parametrize("asked_on", [True, False], ids=["asked_on", "asked_off"])
@pytest.mark.parametrize("toggle", sorted(TOGGLED))
@pytest.mark.parametrize("model_name", MODELS)
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
