"""`hexi-plan plan --islands sites|auto`: one island per site, balanced batch, H, auto's choice."""

from dataclasses import replace

import pytest

from planner import search_islands
from planner.cluster import load_cluster, load_cluster_dict
from planner.membership import PlanningOptions
from planner.models import load_model
from planner.plan import plan_from_dict
from planner.search_islands import IslandRequest, plan_islands, site_clusters
from planner.simulator import simulate

# Island step times of the joined plan may differ by this much: the search's step times jump
# with the batch (micro-batch sizes and counts change), so equal times are not always reachable.
BALANCE_TOLERANCE = 0.15


@pytest.fixture(scope="module")
def model(examples_dir):
    return load_model(examples_dir / "models" / "small-1b.yaml")


def _two_sites(examples_dir, bandwidth):
    c = load_cluster(examples_dir / "clusters" / "two-site-mini.yaml").to_dict()
    c["sites"] = {"links": [{"between": ["east", "west"], "bandwidth": bandwidth}]}
    return load_cluster_dict(c)


def _samples(plan, pipes):
    return sum(plan.pipelines[p].num_samples for p in pipes)


def test_islands_by_site_balanced_and_fitting(examples_dir, model):
    cluster = load_cluster(examples_dir / "clusters" / "two-site-mini.yaml")
    options = PlanningOptions(64)
    plan = plan_islands(cluster, model, options, IslandRequest("sites"))
    plan_from_dict(plan.to_dict())  # validates
    est = simulate(plan)
    assert est.fits_memory and plan.estimate["fits_memory"]
    # one island per site, holding all of its GPUs
    site_of = {n.name: n.site for n in cluster.nodes}
    sites = [
        {site_of[plan.ranks[r].node] for p in pipes for r in plan.pipelines[p].ranks}
        for pipes in plan.islands
    ]
    assert sites == [{"east"}, {"west"}]
    assert sorted(r for p in plan.pipelines for r in p.ranks) == list(range(4))
    # the batch: all of it, split so that the island steps match within the tolerance, and no
    # single sample moved from the slowest island to the fastest would shorten the slowest
    batches = [_samples(plan, pipes) for pipes in plan.islands]
    assert sum(batches) == 64
    times = est.island_step_time_s
    assert max(times) <= (1 + BALANCE_TOLERANCE) * min(times)
    slow, fast = times.index(max(times)), times.index(min(times))
    moved = list(batches)
    moved[slow] -= 1
    moved[fast] += 1
    opts = replace(options, recompute="on" if plan.training.recompute else options.recompute)
    alt = search_islands._site_plans(site_clusters(cluster), model, opts, moved)
    assert max(p.estimate["iteration_time_s"] for p in alt) >= max(
        p.estimate["iteration_time_s"]
        for p in search_islands._site_plans(site_clusters(cluster), model, opts, batches)
    )
    # H: the smallest interval whose exposed outer sync is at most 10 % of the step
    h = plan.training.outer.interval
    assert est.outer_sync_time_s <= 0.10 * est.iteration_time_s
    plan.training = replace(plan.training, outer=replace(plan.training.outer, interval=h - 1))
    shorter = simulate(plan)
    assert shorter.outer_sync_time_s > 0.10 * shorter.iteration_time_s
    assert plan.estimate["bottleneck"].startswith(f"islands by site (batch {batches[0]}/")


def test_auto_chooses_synchronous_on_fast_links_and_islands_on_slow(examples_dir, model):
    options = PlanningOptions(64)
    fast = plan_islands(
        _two_sites(examples_dir, "100 Gbit/s"), model, options, IslandRequest("auto")
    )
    assert fast.islands == () and fast.training.outer is None
    assert fast.estimate["bottleneck"].startswith("synchronous (auto: ")
    slow = plan_islands(
        _two_sites(examples_dir, "100 Mbit/s"), model, options, IslandRequest("auto")
    )
    assert len(slow.islands) == 2 and slow.training.outer is not None
    assert slow.estimate["bottleneck"].startswith("islands by site")
    assert (
        "of the synchronous step goes to the site links, above 10%" in (slow.estimate["bottleneck"])
    )
    sync = plan_islands(
        _two_sites(examples_dir, "100 Mbit/s"), model, options, IslandRequest("off")
    )
    assert slow.estimate["tokens_per_s"] > 2 * sync.estimate["tokens_per_s"]


def test_given_outer_settings_are_kept(examples_dir, model):
    cluster = load_cluster(examples_dir / "clusters" / "two-site-mini.yaml")
    request = IslandRequest("sites", outer={"interval": 7, "compression": "int8", "fragments": 2})
    plan = plan_islands(cluster, model, PlanningOptions(64), request)
    o = plan.training.outer
    assert (o.interval, o.compression, o.fragments) == (7, "int8", 2)
    assert plan.estimate["outer_sync_time_s"] == simulate(plan).outer_sync_time_s


def test_chosen_interval_is_capped_for_convergence(examples_dir, model):
    """Over a link slow enough that 10 % of the step needs H above the cap, H is the cap
    (search_islands.DEFAULT_MAX_INTERVAL unless given), the outer sync then takes more than
    10 %, and the reason says so; a larger cap gives the larger H the share asks for."""
    cluster = _two_sites(examples_dir, "1 Mbit/s")
    options = PlanningOptions(64)
    wide = plan_islands(cluster, model, options, IslandRequest("sites", max_interval=10**6))
    h = wide.training.outer.interval
    assert h > search_islands.DEFAULT_MAX_INTERVAL
    capped = plan_islands(cluster, model, options, IslandRequest("sites"))
    assert capped.training.outer.interval == search_islands.DEFAULT_MAX_INTERVAL
    est = simulate(capped)
    assert est.outer_sync_time_s > 0.10 * est.iteration_time_s
    assert "H is capped at --outer-max-interval 500" in capped.estimate["bottleneck"]
    assert capped.estimate["tokens_per_s"] < wide.estimate["tokens_per_s"]
    # a cap above the share's H leaves it alone
    loose = plan_islands(cluster, model, options, IslandRequest("sites", max_interval=h + 1))
    assert loose.training.outer.interval == h


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--cluster", "examples/clusters/mini-hetero.yaml", "--islands", "sites"],
         "--islands: cluster 'mini-hetero' has one site"),
        (["--cluster", "examples/clusters/two-site-mini.yaml", "--outer-lr", "0.5"],
         "--outer-lr: needs --islands sites or auto"),
        (["--cluster", "examples/clusters/two-site-mini.yaml", "--islands", "sites",
          "--outer-max-comm-share", "1.5"], "--outer-max-comm-share"),
        (["--cluster", "examples/clusters/two-site-mini.yaml", "--islands", "everywhere"],
         "--islands"),
        (["--cluster", "examples/clusters/two-site-mini.yaml", "--islands", "sites",
          "--outer-max-interval", "0"], "--outer-max-interval"),
        (["--cluster", "examples/clusters/two-site-mini.yaml", "--islands", "sites",
          "--outer-fragments", "9"], "--outer-fragments: 9 fragments, but the model has only 4"),
    ],
)  # fmt: skip
def test_plan_islands_bad_input_is_one_line(hexi_plan, repo_root, monkeypatch, argv, line):
    monkeypatch.chdir(repo_root)
    code, out, err = hexi_plan(
        "plan", "--model", "tiny", "--global-batch-size", "8", *argv, "-o", "/dev/null"
    )
    assert code == 2 and len(err.strip().splitlines()) == 1 and line in err, err
