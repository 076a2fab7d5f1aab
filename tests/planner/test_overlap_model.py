"""The overlapped gradient sync: collectives start when their gradients are complete, queue on
shared NICs, and only what outlasts the pipelines' compute (or, for the distributed optimizer's
parameter all-gather, the next forward) is exposed. With overlap off the estimate is exactly the
serial one, pinned here to the values the simulator gave before the overlap model existed."""

import json
import os

import pytest
from host_zero import pinned_model, zero_host_time

from planner.cluster import load_cluster, load_cluster_dict
from planner.errors import SpecError
from planner.membership import PlanningOptions, plan_for
from planner.models import load_model
from planner.plan import build_plan, load_plan, plan_from_dict
from planner.schedule import last_backward_ends, pipeline_time
from planner.search import overlap_by_default, search_plan
from planner.simulator import layouts_of, simulate, simulate_layout
from planner.sync_model import (
    BUCKET_ELEMENTS,
    StageLayout,
    StageTiming,
    Timings,
    buckets,
    collectives,
    overlapped_sync_time,
    rank_sets,
    sync_time,
)
from planner.topology import Topology, boundary_times

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = load_model("tiny")


def _cluster(nodes, gpus_per_node=1, nic="10 Gbit/s", intra="nvlink"):
    """`nodes` machines of `gpus_per_node` A100s each, named n0, n1, ..."""
    return load_cluster_dict(
        {
            "name": "lab",
            "nodes": [
                {"name": "n", "gpu": "A100-SXM-80GB", "gpus_per_node": gpus_per_node,
                 "count": nodes, "intra_node": intra, "nic": nic}
            ],
        }
    )  # fmt: skip


def _ring_allreduce(nbytes, n, bw, lat):
    return 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * lat


ONE_BUCKET = 10**12  # a bucket bound no set here reaches: one collective per rank set


# -------------------------------------------------------------------- the 1F1B end times


def test_last_backward_ends_by_hand():
    """3 stages of 1 s forward and 2 s backward, 4 micro-batches, no transfers: the last stage's
    last backward ends at 14 s, each earlier stage one backward (2 s) later; stage 0 ends with
    the pipeline."""
    assert last_backward_ends([1, 1, 1], [2, 2, 2], [0, 0], [0, 0], 4) == (18.0, 16.0, 14.0)
    assert pipeline_time([1, 1, 1], [2, 2, 2], [0, 0], [0, 0], 4) == 18.0
    # with transfers back, each earlier stage waits for the transfer too
    assert last_backward_ends([1, 1], [2, 2], [0.5], [0.25], 1) == pytest.approx(
        (1 + 0.5 + 1 + 2 + 0.25 + 2, 1 + 0.5 + 1 + 2)
    )


def test_last_backward_ends_beyond_the_simulated_count():
    """Past the simulated micro-batch count stage 0 ends at the extrapolated pipeline time and
    the other stages keep their distance to it."""
    f, b, x = [0.3, 0.5, 0.4], [0.6, 1.0, 0.8], [0.01, 0.02]
    m = 200
    ends = last_backward_ends(f, b, x, x, m)
    assert ends[0] == pytest.approx(pipeline_time(f, b, x, x, m))
    near = last_backward_ends(f, b, x, x, 24)
    assert [ends[0] - e for e in ends] == pytest.approx([near[0] - e for e in near])
    assert ends[2] < ends[1] < ends[0]


def test_stage_produces_its_layers_last_first():
    """Layers [4, 8), 0.4 s backward ending at 10 s: layer 7 is done after a quarter of it, layer
    4 at the end; the output layer (8) counts as layer 7, the embedding (0) as layer 4."""
    t = StageTiming(grads_done=10.0, bwd=0.4, fwd=0.2, first=4, last=8)
    assert t.ready(7) == pytest.approx(10.0 - 0.3)
    assert t.ready(6) == pytest.approx(10.0 - 0.2)
    assert t.ready(4) == pytest.approx(10.0)
    assert t.ready(8) == pytest.approx(10.0 - 0.3)
    assert t.ready(0) == pytest.approx(10.0)


# ------------------------------------------------------------- overlapped_sync_time by hand


def _timing(ranks, grads_done, fwd=0.1, bwd=0.2, first=0, last=4):
    return Timings.of({r: StageTiming(grads_done, bwd, fwd, first, last) for r in ranks})


def test_one_collective_ready_at_a_known_time():
    """One all-reduce of 100M fp32 elements over two machines (10 Gbit/s): ready at 1.0 s, the
    pipelines end at 1.2 s; exposed = finish - pipeline end."""
    topo = Topology(_cluster(2))
    bw, lat = topo.slowest((0, 1))
    assert bw == pytest.approx(1.25e9)
    elems = 100_000_000
    t = _ring_allreduce(4 * elems, 2, bw, lat)
    assert t == pytest.approx(0.32 + 2 * lat)
    got = overlapped_sync_time(
        {(0, 1): {0: elems}}, topo, False, _timing((0, 1), 1.0), 1.2, True, False, ONE_BUCKET
    )
    assert got.exposed == pytest.approx(1.0 + t - 1.2)
    assert got.serial == pytest.approx(t)
    # fully hidden when it finishes before the pipelines do
    got = overlapped_sync_time(
        {(0, 1): {0: elems}}, topo, False, _timing((0, 1), 1.0), 1.5, True, False, ONE_BUCKET
    )
    assert got.exposed == 0.0
    # the slowest holder decides when it may start
    timing = Timings.of({0: StageTiming(0.5, 0.2, 0.1, 0, 4), 1: StageTiming(1.1, 0.2, 0.1, 0, 4)})
    got = overlapped_sync_time(
        {(0, 1): {0: elems}}, topo, False, timing, 1.2, True, False, ONE_BUCKET
    )
    assert got.exposed == pytest.approx(1.1 + t - 1.2)
    # serial (no overlap flag): all of it
    got = overlapped_sync_time(
        {(0, 1): {0: elems}}, topo, False, _timing((0, 1), 1.0), 1.2, False, False, ONE_BUCKET
    )
    assert got.exposed == pytest.approx(t)


def test_collectives_on_one_nic_queue():
    """(0, 1) and (0, 2) both use machine 0's NIC: the second waits for the first. (0, 1) and
    (2, 3) share no machine: they run at the same time."""
    topo = Topology(_cluster(4))
    bw, lat = topo.slowest((0, 1))
    elems = 200_000_000
    t = _ring_allreduce(4 * elems, 2, bw, lat)
    timing = _timing(range(4), 1.0)
    shared = {(0, 1): {0: elems}, (0, 2): {0: elems}}
    got = overlapped_sync_time(shared, topo, False, timing, 1.0, True, False, ONE_BUCKET)
    assert got.exposed == pytest.approx(2 * t)
    disjoint = {(0, 1): {0: elems}, (2, 3): {0: elems}}
    got = overlapped_sync_time(disjoint, topo, False, timing, 1.0, True, False, ONE_BUCKET)
    assert got.exposed == pytest.approx(t)
    assert got.serial == pytest.approx(2 * t)
    # the one ready first goes first: (0, 2), ready at 0.5 s, runs during the backward and
    # (0, 1), ready at 1.0 s, starts when machine 0's NIC is free
    timing = Timings.of({0: StageTiming(0.5, 0.2, 0.1, 0, 4), 1: StageTiming(1.0, 0.2, 0.1, 0, 4),
                         2: StageTiming(0.5, 0.2, 0.1, 0, 4)})  # fmt: skip
    got = overlapped_sync_time(shared, topo, False, timing, 1.0, True, False, ONE_BUCKET)
    assert 0.5 + t > 1.0
    assert got.exposed == pytest.approx(0.5 + t + t - 1.0)


def test_collective_inside_a_machine_uses_its_own_link():
    """A set inside machine 0 does not queue behind one between machines 1 and 2."""
    topo = Topology(_cluster(3, gpus_per_node=2))
    elems = 25_000_000
    inside = topo.slowest((0, 1))
    across = topo.slowest((2, 4))
    t_in = _ring_allreduce(4 * elems, 2, *inside)
    t_across = _ring_allreduce(4 * elems, 2, *across)
    sets = {(0, 1): {0: elems}, (2, 4): {0: elems}}
    got = overlapped_sync_time(sets, topo, False, _timing(range(6), 1.0), 1.0, True, False)
    assert got.exposed == pytest.approx(max(t_in, t_across))
    # (0, 2) spans machines 0 and 1: it queues behind (2, 4) on machine 1's NIC
    sets = {(0, 2): {0: elems}, (2, 4): {0: elems}}
    got = overlapped_sync_time(sets, topo, False, _timing(range(6), 1.0), 1.0, True, False)
    assert got.exposed == pytest.approx(2 * t_across)


def test_param_gather_hidden_up_to_the_forward():
    """Distributed optimizer: reduce-scatter (fp32) then all-gather (bf16) of 50M elements over
    two machines. The all-gather hides behind one forward of the holders' stage; only the excess
    is exposed, and without --overlap-param-gather all of it is."""
    topo = Topology(_cluster(2))
    bw, lat = topo.slowest((0, 1))
    elems = 50_000_000
    rs = 0.5 * 4 * elems / bw + lat
    ag = 0.5 * 2 * elems / bw + lat
    sets = {(0, 1): {0: elems}}

    def run(fwd, grad, gather):
        timing = _timing((0, 1), 1.0, fwd=fwd)
        return overlapped_sync_time(sets, topo, True, timing, 1.0, grad, gather, ONE_BUCKET).exposed

    assert run(1.0, True, True) == pytest.approx(rs)  # a forward longer than the gather
    assert run(0.01, True, True) == pytest.approx(rs + ag - 0.01)
    assert run(0.01, True, False) == pytest.approx(rs + ag)
    assert run(0.01, False, True) == pytest.approx(rs + ag - 0.01)
    assert run(1.0, False, False) == pytest.approx(rs + ag)
    # the forward is the shortest holder's
    timing = Timings.of({0: StageTiming(1.0, 0.2, 1.0, 0, 4), 1: StageTiming(1.0, 0.2, 0.02, 0, 4)})
    got = overlapped_sync_time(sets, topo, True, timing, 1.0, True, True, ONE_BUCKET)
    assert got.exposed == pytest.approx(rs + ag - 0.02)


def test_collectives_mirror_rank_sets():
    """Same sets, same sizes as rank_sets; the lowest layer per set: the first stages' sets
    hold the embedding (layer 0), the last stages' the output layer, and layers 2-3 start at 2."""
    layout = [
        [StageLayout((0,), (0, 2), (4,), (256,), (128,)),
         StageLayout((1,), (2, 4), (4,), (256,), (128,))],
        [StageLayout((2,), (0, 2), (4,), (256,), (128,)),
         StageLayout((3,), (2, 4), (4,), (256,), (128,))],
    ]  # fmt: skip
    got = collectives(TINY, layout)
    assert {k: sum(v.values()) for k, v in got.items()} == rank_sets(TINY, layout)
    assert {k: sorted(v) for k, v in got.items()} == {(0, 2): [0, 1], (1, 3): [2, 3, 4]}
    # per layer: QKV, projection, MLP and norms of one layer (h 64, f 256, 4 heads of 16)
    layer = 64 * 3 * 64 + 64 * 64 + 3 * 64 * 256 + 2 * 64
    assert got[0, 2] == {0: layer + 128 * 64, 1: layer}  # + embedding
    assert got[1, 3] == {2: layer, 3: layer, 4: 128 * 64 + 64}  # output layer, final norm


def test_buckets_are_cut_as_the_runtime_cuts_them():
    """Buckets of 40M elements, last layer first, cut inside layers, the rest in the last one:
    (layer each closes in, buckets, elements each, elements of the last)."""
    M = 1_000_000
    assert buckets({0: 30 * M, 1: 30 * M, 2: 10 * M, 3: 5 * M}) == [
        (1, 1, 40 * M, 40 * M),  # layers 3, 2 and 25M of layer 1
        (0, 1, 40 * M, 35 * M),  # 5M of layer 1 and layer 0
    ]
    assert buckets({0: 100 * M, 1: 1}) == [(0, 3, 40 * M, 20 * M + 1)]
    assert buckets({0: 5, 4: 7}) == [(0, 1, 40 * M, 12)]
    assert buckets({0: 80 * M, 1: 40 * M}) == [(1, 1, 40 * M, 40 * M), (0, 2, 40 * M, 40 * M)]
    assert buckets({0: 10, 1: 10, 2: 10}, 10) == [(2, 1, 10, 10), (1, 1, 10, 10), (0, 1, 10, 10)]
    # every element in exactly one bucket
    for layers in ({0: 7, 3: 123, 5: 64}, {i: 1000 + 37 * i for i in range(9)}):
        for bound in (1, 10, 64, 500, 10**6):
            got = buckets(layers, bound)
            assert sum((k - 1) * e + last for _, k, e, last in got) == sum(layers.values())
            assert all(0 < last <= e == bound for _, _, e, last in got)
            assert sum(k for _, k, _, _ in got) == -(-sum(layers.values()) // bound)


def test_each_bucket_pays_its_own_latency():
    """200M elements in buckets of 40M: five collectives. Serial, they take the bandwidth term
    of the whole set plus five latencies; with the set in one bucket, one latency."""
    topo = Topology(_cluster(2))
    bw, lat = topo.slowest((0, 1))
    elems = 200_000_000
    timing = _timing((0, 1), 1.0)
    one = overlapped_sync_time(
        {(0, 1): {0: elems}}, topo, False, timing, 1.0, True, False, ONE_BUCKET
    )
    five = overlapped_sync_time({(0, 1): {0: elems}}, topo, False, timing, 1.0, True, False)
    assert one.serial == pytest.approx(_ring_allreduce(4 * elems, 2, bw, lat))
    assert five.serial == pytest.approx(5 * _ring_allreduce(4 * 40_000_000, 2, bw, lat))
    assert five.serial - one.serial == pytest.approx(4 * 2 * lat)
    # all ready at once: all of it exposed
    assert five.exposed == pytest.approx(five.serial)
    # the distributed optimizer: a reduce-scatter and an all-gather per bucket
    five = overlapped_sync_time({(0, 1): {0: elems}}, topo, True, timing, 1.0, True, False)
    one = overlapped_sync_time(
        {(0, 1): {0: elems}}, topo, True, timing, 1.0, True, False, ONE_BUCKET
    )
    assert five.serial - one.serial == pytest.approx(4 * 2 * lat)
    # without overlap_grad_reduce the runtime keeps one bucket per set, whatever the bound
    got = overlapped_sync_time({(0, 1): {0: elems}}, topo, True, timing, 1.0, False, True)
    assert got.serial == pytest.approx(one.serial)


def test_large_layers_start_before_the_stage_ends():
    """Two layers of 40M elements on one stage (so two buckets): the last layer's bucket
    starts half-way through the stage's last backward, the first layer's when it ends."""
    topo = Topology(_cluster(2))
    bw, lat = topo.slowest((0, 1))
    per = 40_000_000
    t = _ring_allreduce(4 * per, 2, bw, lat)  # one bucket's time
    timing = _timing((0, 1), 10.0, bwd=0.2, first=0, last=2)
    got = overlapped_sync_time({(0, 1): {0: per, 1: per}}, topo, False, timing, 10.0, True, False)
    first_done = 10.0 - 0.1 + t
    assert first_done > 10.0
    assert got.exposed == pytest.approx(first_done + t - 10.0)
    assert got.serial == pytest.approx(2 * t)


# ------------------------------------------------------------------- the simulator


# Before the overlap model: (plan, distributed optimizer) -> (iteration, gradient sync) seconds;
# the iterations re-recorded under the kernel model (planner.kernels), the syncs unchanged
BEFORE = {
    ("hetero-4rank.json", False): (0.0037458091076923083, 0.0011935424),
    ("hetero-4rank.json", True): (0.0035179485717948718, 0.0009701567999999999),
    ("mixed-lab-manual.json", False): (45.711676918293875, 28.759626610488898),
    ("mixed-lab-manual.json", True): (38.48789420525498, 21.57186495786667),
}


def _example(name, dist_opt, grad=False, gather=False, attention="unfused"):
    d = json.loads(open(os.path.join(ROOT, "examples/plans", name)).read())
    d["training"].update(
        use_distributed_optimizer=dist_opt,
        overlap_grad_reduce=grad,
        overlap_param_gather=gather,
        attention_backend=attention,
    )
    return plan_from_dict(d)


@pytest.mark.parametrize("name,dist_opt", sorted(BEFORE))
def test_overlap_off_is_the_serial_estimate(name, dist_opt, monkeypatch):
    pinned_model(monkeypatch)
    iteration, sync = BEFORE[name, dist_opt]
    # BEFORE predates the attention backend, whose time was then a fused one's (FLOPs only)
    est = simulate(_example(name, dist_opt, attention="auto"))
    assert est.iteration_time_s == pytest.approx(iteration, rel=1e-12)
    assert est.grad_sync_time_s == pytest.approx(sync, rel=1e-12)
    assert est.grad_sync_serial_s == est.grad_sync_time_s
    assert "grad_sync_serial_s" not in est.to_dict()


def _extra_bucket_latency(plan, dist_opt, bucketed):
    """Seconds the latency of the overlapped sync's extra buckets adds (2 (n - 1) hops each,
    all-reduce or reduce-scatter + all-gather alike) over one collective per rank set."""
    if not bucketed:
        return 0.0
    topo = Topology(plan.cluster)
    extra = 0.0
    for ranks, layers in collectives(plan.model, layouts_of(plan), dist_opt).items():
        if len(ranks) > 1:
            count = -(-sum(layers.values()) // BUCKET_ELEMENTS)
            extra += (count - 1) * 2 * (len(ranks) - 1) * topo.slowest(ranks)[1]
    return extra


@pytest.mark.parametrize("name,dist_opt", sorted(BEFORE))
def test_overlap_never_predicts_a_longer_iteration(name, dist_opt):
    serial = simulate(_example(name, dist_opt))
    flags = [(True, False)] + ([(True, True), (False, True)] if dist_opt else [])
    for grad, gather in flags:
        plan = _example(name, dist_opt, grad, gather)
        est = simulate(plan)
        assert est.iteration_time_s <= serial.iteration_time_s * (1 + 1e-12), (grad, gather)
        assert est.grad_sync_time_s <= serial.grad_sync_time_s * (1 + 1e-12)
        # the same collectives cut into buckets: one more latency term per extra bucket
        assert est.grad_sync_serial_s == pytest.approx(
            serial.grad_sync_time_s + _extra_bucket_latency(plan, dist_opt, grad),
            rel=1e-12,
        )
        assert est.pipeline_time_s == serial.pipeline_time_s
        d = est.to_dict()
        assert d["grad_sync_exposed_s"] == d["grad_sync_time_s"] == est.grad_sync_time_s
        assert d["grad_sync_serial_s"] == est.grad_sync_serial_s
    # the 4-rank example: its biggest set's holders finish early; overlap hides part of it
    est = simulate(_example(name, dist_opt, True, dist_opt))
    assert est.iteration_time_s < serial.iteration_time_s


def test_simulated_two_pipelines_by_hand():
    """Two pipelines of two stages, each pipeline on its own machine (NVLink inside, 10 Gbit/s
    between): the last stages' set (1, 3) is ready when their last backward ends, the first
    stages' set (0, 2) when the pipelines end; both cross the same two NICs, so (0, 2) queues
    behind (1, 3)."""
    cluster = _cluster(2, gpus_per_node=2)
    pipes = [
        {"micro_batch_size": 1, "num_microbatches": 4,
         "stages": [{"ranks": [2 * i], "layers": [0, 2]},
                    {"ranks": [2 * i + 1], "layers": [2, 4]}]}
        for i in range(2)
    ]  # fmt: skip
    serial_plan = build_plan(cluster, TINY, 8, pipes)
    plan = build_plan(cluster, TINY, 8, pipes, overlap_grad_reduce=True)
    topo = Topology(cluster)
    serial, est = simulate(serial_plan), simulate(plan)

    sets = rank_sets(TINY, layouts_of(plan))
    assert sorted(sets) == [(0, 2), (1, 3)]
    bw, lat = topo.slowest((0, 2))
    t02 = _ring_allreduce(4 * sets[0, 2], 2, bw, lat)
    t13 = _ring_allreduce(4 * sets[1, 3], 2, bw, lat)
    assert serial.grad_sync_time_s == pytest.approx(t02 + t13)

    s0, s1 = est.stages[0], est.stages[1]  # pipeline 0's stages (both pipelines are alike)
    (tf, _), (tb, _) = boundary_times(TINY, 1, (0,), (1,), topo)
    ends = last_backward_ends([s0.fwd, s1.fwd], [s0.bwd, s1.bwd], [tf], [tb], 4)
    P = max(est.pipeline_time_s)
    assert ends[0] == pytest.approx(P)
    assert ends[1] < P
    finish_13 = ends[1] + t13
    finish_02 = max(P, finish_13) + t02
    assert est.grad_sync_time_s == pytest.approx(finish_02 - P)
    assert est.iteration_time_s == pytest.approx(P + (finish_02 - P) + est.optimizer_step_time_s)
    assert est.grad_sync_serial_s == pytest.approx(serial.grad_sync_time_s)
    assert est.iteration_time_s < serial.iteration_time_s


def test_bottleneck_says_exposed(monkeypatch):
    zero_host_time(monkeypatch)
    """A plan limited by its sync says how much is exposed and of how much."""
    cluster = load_cluster_dict(
        {"name": "slow", "nodes": [{"name": "n", "gpu": "A100-SXM-80GB", "gpus_per_node": 1,
                                    "count": 2, "intra_node": "nvlink", "nic": "1 Gbit/s"}]}
    )  # fmt: skip
    pipes = [
        {"micro_batch_size": 1, "num_microbatches": 4, "stages": [{"ranks": [i], "layers": [0, 4]}]}
        for i in range(2)
    ]
    est = simulate(build_plan(cluster, TINY, 8, pipes, overlap_grad_reduce=True))
    # one stage per pipeline: everything is ready only when the pipelines end
    assert est.grad_sync_time_s == pytest.approx(est.grad_sync_serial_s)
    assert est.bottleneck.startswith(
        f"communication-bound: gradient sync {est.grad_sync_time_s:.3g} s exposed of "
        f"{est.iteration_time_s:.3g} s ({est.grad_sync_serial_s:.3g} s of collectives, overlapped)"
    )


# ------------------------------------------------------------------------- search and CLI


def test_search_writes_and_costs_the_overlap():
    cluster = load_cluster(os.path.join(ROOT, "examples/clusters/paper-a100-pcie-4x8.yaml"))
    model = load_model("llama2-7b")
    serial = search_plan(cluster, model, 64, micro_batch_size=1)
    over = search_plan(cluster, model, 64, micro_batch_size=1, overlap_grad_reduce=True)
    assert not serial.training.overlap_grad_reduce
    assert over.training.overlap_grad_reduce and not over.training.overlap_param_gather
    assert over.estimate["iteration_time_s"] == pytest.approx(simulate(over).iteration_time_s)
    assert over.estimate["grad_sync_exposed_s"] < over.estimate["grad_sync_serial_s"]
    # the serial plan re-costed with overlap is no better than the plan searched with it
    recosted = simulate(
        plan_from_dict({**serial.to_dict(), "training": over.training.to_dict()})
    ).iteration_time_s
    assert over.estimate["iteration_time_s"] <= recosted
    # on this 25 Gbit/s cluster overlap opens data parallelism: one pipeline before
    assert len(serial.pipelines) == 1 and len(over.pipelines) > 1


def test_overlap_by_default_is_for_gpus():
    assert overlap_by_default(
        load_cluster(os.path.join(ROOT, "examples/clusters/mini-hetero.yaml"))
    )
    assert not overlap_by_default(load_cluster(os.path.join(ROOT, "examples/clusters/cpu-1.yaml")))


def test_planning_options_pass_through():
    cluster = load_cluster(os.path.join(ROOT, "examples/clusters/mini-hetero.yaml"))
    plan = plan_for(cluster, TINY, PlanningOptions(8, micro_batch_size=1))
    assert not plan.training.overlap_grad_reduce
    plan = plan_for(
        cluster,
        TINY,
        PlanningOptions(
            8,
            micro_batch_size=1,
            use_distributed_optimizer=True,
            overlap_grad_reduce=True,
            overlap_param_gather=True,
        ),
    )
    assert plan.training.overlap_grad_reduce and plan.training.overlap_param_gather
    assert "grad_sync_serial_s" in plan.estimate


def _plan_cli(hexi_plan, tmp_path, cluster, *flags):
    out = tmp_path / "plan.json"
    code, stdout, err = hexi_plan(
        "plan", "--cluster", os.path.join(ROOT, "examples/clusters", cluster), "--model", "tiny",
        "--global-batch-size", "8", "--micro-batch-size", "1", "-o", out, *flags,
    )  # fmt: skip
    assert code == 0, err
    return json.loads(out.read_text())["training"]


def test_plan_defaults_on_gpus_off_on_cpus(hexi_plan, tmp_path):
    t = _plan_cli(hexi_plan, tmp_path, "mini-hetero.yaml")
    assert t.get("overlap_grad_reduce") is True and "overlap_param_gather" not in t
    t = _plan_cli(hexi_plan, tmp_path, "mini-hetero.yaml", "--use-distributed-optimizer")
    assert t.get("overlap_grad_reduce") is True and t.get("overlap_param_gather") is True
    t = _plan_cli(hexi_plan, tmp_path, "cpu-1.yaml")
    assert "overlap_grad_reduce" not in t and "overlap_param_gather" not in t
    t = _plan_cli(hexi_plan, tmp_path, "cpu-1.yaml", "--overlap-grad-reduce")
    assert t.get("overlap_grad_reduce") is True


def test_plan_no_overlap_flags(hexi_plan, tmp_path):
    t = _plan_cli(hexi_plan, tmp_path, "mini-hetero.yaml", "--no-overlap-grad-reduce")
    assert "overlap_grad_reduce" not in t
    t = _plan_cli(
        hexi_plan, tmp_path, "mini-hetero.yaml", "--use-distributed-optimizer",
        "--no-overlap-param-gather",
    )  # fmt: skip
    assert t.get("overlap_grad_reduce") is True and "overlap_param_gather" not in t


PARAM_GATHER_ERROR = (
    "hexi-plan: error: --overlap-param-gather: needs --use-distributed-optimizer (only the "
    "distributed optimizer all-gathers parameters)\n"
)


def test_param_gather_needs_the_distributed_optimizer(hexi_plan, tmp_path):
    code, out, err = hexi_plan(
        "plan", "--cluster", os.path.join(ROOT, "examples/clusters/mini-hetero.yaml"),
        "--model", "tiny", "--global-batch-size", "8", "-o", tmp_path / "p.json",
        "--overlap-param-gather",
    )  # fmt: skip
    assert (code, err) == (2, PARAM_GATHER_ERROR)
    code, out, err = hexi_plan(
        "manual", "--cluster", os.path.join(ROOT, "examples/clusters/mini-hetero.yaml"),
        "--model", "tiny", "--global-batch-size", "8",
        "--pipelines", os.path.join(ROOT, "examples/pipelines/hetero-4rank.json"),
        "-o", tmp_path / "p.json", "--overlap-param-gather",
    )  # fmt: skip
    assert (code, err) == (2, PARAM_GATHER_ERROR)
    assert not (tmp_path / "p.json").exists()
    with pytest.raises(SpecError, match="--overlap-param-gather: needs"):
        search_plan(load_cluster(os.path.join(ROOT, "examples/clusters/mini-hetero.yaml")),
                    TINY, 8, overlap_param_gather=True)  # fmt: skip


def test_manual_defaults_off_and_show_prints_the_settings(hexi_plan, tmp_path):
    def manual(*flags):
        out = tmp_path / "m.json"
        code, _, err = hexi_plan(
            "manual", "--cluster", os.path.join(ROOT, "examples/clusters/mini-hetero.yaml"),
            "--model", "tiny", "--global-batch-size", "8",
            "--pipelines", os.path.join(ROOT, "examples/pipelines/hetero-4rank.json"),
            "-o", out, *flags,
        )  # fmt: skip
        assert code == 0, err
        return out

    out = manual()
    assert "overlap_grad_reduce" not in json.loads(out.read_text())["training"]
    code, stdout, _ = hexi_plan("show", out)
    assert "overlap-grad-reduce off, overlap-param-gather off" in stdout
    out = manual("--overlap-grad-reduce", "--use-distributed-optimizer", "--overlap-param-gather")
    plan = load_plan(out)
    assert plan.training.overlap_grad_reduce and plan.training.overlap_param_gather
    code, stdout, _ = hexi_plan("show", out)
    assert (
        "training: recompute off, optimizer distributed (even shards), overlap-grad-reduce on, "
        "overlap-param-gather on" in stdout
    )
    code, stdout, _ = hexi_plan("validate", out)
    assert code == 0 and "overlap-grad-reduce on, overlap-param-gather on" in stdout
    code, stdout, _ = hexi_plan("simulate", out)
    est = simulate(plan)
    assert (
        f"gradient sync {est.grad_sync_time_s:.4g} s exposed of "
        f"{est.grad_sync_serial_s:.4g} s overlapped" in stdout
    )


def test_search_with_overlap_keeps_estimates_consistent():
    """simulate_layout with the flags gives the same numbers as simulate of the plan."""
    plan = _example("hetero-4rank.json", True, True, True)
    est = simulate(plan)
    again = simulate_layout(
        plan.model, plan.cluster, layouts_of(plan),
        [(p.micro_batch_size, p.num_microbatches) for p in plan.pipelines],
        False, True, "even", None, None, True, True,
    )  # fmt: skip
    assert again.iteration_time_s == est.iteration_time_s
    serial_total, _ = sync_time(rank_sets(plan.model, layouts_of(plan), True),
                                Topology(plan.cluster), True)  # fmt: skip
    assert est.grad_sync_serial_s == pytest.approx(serial_total)
