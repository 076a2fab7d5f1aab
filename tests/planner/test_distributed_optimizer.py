"""The planner with --use-distributed-optimizer: it finds plans that only fit with the option."""

from planner.cluster import load_cluster_dict
from planner.models import load_model
from planner.plan import plan_from_dict
from planner.search import search_plan
from planner.simulator import simulate

FAST_4090S = {
    "name": "fast-4090s",
    "nodes": [
        {
            "name": "m",
            "gpu": "RTX-4090",
            "gpus_per_node": 8,
            "count": 4,
            "intra_node": "pcie4",
            "nic": "200 Gbit/s",
        }
    ],
}


def test_sharded_optimizer_state_opens_plans_that_do_not_fit_without_it():
    cluster, model = load_cluster_dict(FAST_4090S), load_model("llama2-7b")
    plain = search_plan(cluster, model, 512, micro_batch_size=1)
    sharded = search_plan(cluster, model, 512, micro_batch_size=1, use_distributed_optimizer=True)
    assert sharded.training.use_distributed_optimizer
    assert len(sharded.pipelines) > len(plain.pipelines)
    assert sharded.estimate["mfu"] > plain.estimate["mfu"]
    # The same layout without sharding needs more memory than a 24 GB card has.
    data = sharded.to_dict()
    data["training"] = {
        k: v
        for k, v in data["training"].items()
        if k not in ("use_distributed_optimizer", "optimizer_shard")
    }
    unsharded = simulate(plan_from_dict(data))
    assert not unsharded.fits_memory
    assert max(unsharded.peak_memory_gb) > 24
