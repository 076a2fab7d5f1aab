"""Stage-boundary send/receive order cannot deadlock on NCCL (tested with gloo on CPU).

Under HEXI_STRICT_P2P=1 every send and receive is waited on as soon as it is posted, and a gloo
send does not finish before its receive is posted: each rank blocks on one operation at a time,
as a large NCCL send on one stream does. The plans move boundary tensors of tens of MB through
4 micro-batches of 1F1B, on a 1:1 boundary and on a many-to-many one (a TP=2 stage before a TP=1
stage). Training must finish with the same losses as without strict mode, and the previous order
(every rank posts all its sends before its receives) must hang there, caught by the timeout.
The same holds for the communicator alone driven through the 1F1B call sequence over three
stages of TP 2, 3 and 1 (irregular overlaps, boundaries of both parities, launch ranks
permuted), where every received slice is checked.
"""

import multiprocessing

import pytest

from harness import DistributedTimeout, run_distributed
from planner.models import model_from_dict
from planner.plan import build_plan, save_plan
from runtime.plans import cpu_cluster
from runtime.workers import train

# Small layers, short sequences and the cheapest layer parts (GELU, learned positions) keep the
# compute low; many sequences per micro-batch make each boundary tensor (seq x micro-batch x
# hidden fp32) 10.5 MB.
MODEL = {
    "name": "wide-batch",
    "num_layers": 2,
    "hidden_size": 32,
    "ffn_hidden_size": 64,
    "num_attention_heads": 2,
    "num_query_groups": 2,
    "vocab_size": 64,
    "seq_length": 32,
    "swiglu": False,
    "position_embedding_type": "learned_absolute",
}
MICRO_BATCH = 2560
MICRO_BATCHES = 4
PLANS = {
    "two_stages": (2, [{"ranks": [0], "layers": [0, 1]}, {"ranks": [1], "layers": [1, 2]}]),
    "tp2_to_tp1": (3, [{"ranks": [0, 1], "layers": [0, 1]}, {"ranks": [2], "layers": [1, 2]}]),
}
STRICT = {"HEXI_STRICT_P2P": "1"}
# Generous: a finishing run takes well under this even on a loaded machine.
RUN_TIMEOUT = 400
# The previous order hangs at the first steady-state exchange, a few seconds of compute after
# start-up (none without a model). The harness sees it within seconds (every rank's stack unchanged
# in `_exchange`); these only bound how long the tests wait for that.
HANG_TIMEOUT = 60
COMMUNICATOR_HANG_TIMEOUT = 30


# Communicator alone: plan rank -> launch rank (permuted), stages' plan ranks, micro-batches.
LAUNCH_OF = {0: 3, 1: 0, 2: 5, 3: 1, 4: 4, 5: 2}
STAGES = [[0, 1], [2, 3, 4], [5]]
SHAPE = (64, 640, 64)  # 10.5 MB fp32 per boundary tensor


def _sends_first(self, sends, recvs):
    """The previous order: every rank posts all its sends, then all its receives."""
    return sends + recvs


def train_one_step(plan_path, previous_order=False):
    """One training iteration; the losses and grad norms (launch rank 0)."""
    if previous_order:
        from megatron_hexi.communicator import StageCommunicator

        StageCommunicator._order = _sends_first
    out = train(plan_path, extra_flags=["--train-iters", "1"])
    return {"losses": out["losses"], "grad_norms": out["grad_norms"]}


def _message(kind, stage, micro_batch):
    """The tensor a stage sends for one micro-batch: every element tells where it belongs."""
    import torch

    code = {"forward": 0, "backward": 1}[kind] * 50 + 10 * stage + micro_batch
    return (
        torch.arange(SHAPE[0] * SHAPE[1] * SHAPE[2], dtype=torch.float32)
        .remainder_(4099)
        .add_(4099 * code)
        .view(SHAPE)
    )


def communicate_1f1b(micro_batches, previous_order=False):
    """Drive one StageCommunicator through megatron-core's 1F1B call sequence (no model);
    check every tensor received; return what this rank received, in order."""
    import torch
    import torch.distributed as dist

    from megatron_hexi.communicator import Boundary, StageCommunicator
    from megatron_hexi.process_groups import StagePosition

    if previous_order:
        StageCommunicator._order = _sends_first
    plan_of = {launch: plan for plan, launch in LAUNCH_OF.items()}
    me = plan_of[dist.get_rank()]
    groups = [dist.new_group(sorted(LAUNCH_OF[r] for r in ranks)) for ranks in STAGES]
    stage = next(i for i, ranks in enumerate(STAGES) if me in ranks)
    n, numel = len(STAGES), SHAPE[0] * SHAPE[1] * SHAPE[2]
    prev_b = Boundary(STAGES[stage - 1], STAGES[stage], numel, LAUNCH_OF, me) if stage else None
    next_b = (
        Boundary(STAGES[stage], STAGES[stage + 1], numel, LAUNCH_OF, me) if stage < n - 1 else None
    )
    comm = StageCommunicator(
        None,
        StagePosition(stage, n),
        groups[stage],
        len(STAGES[stage]),
        prev_b,
        next_b,
        torch.float32,
        torch.device("cpu"),
    )
    first, last = stage == 0, stage == n - 1
    received = []

    def check(tensor, kind, m):
        if tensor is None:
            return
        sender = stage - 1 if kind == "forward" else stage + 1
        if not torch.equal(tensor, _message(kind, sender, m)):
            raise AssertionError(f"stage {stage}: wrong {kind} tensor for micro-batch {m}")
        received.append((kind, m))

    warmup = min(n - stage - 1, micro_batches)
    steady = micro_batches - warmup
    for m in range(warmup):
        check(comm.recv_forward(SHAPE, first), "forward", m)
        comm.send_forward(_message("forward", stage, m), last)
    if steady:
        check(comm.recv_forward(SHAPE, first), "forward", warmup)
    for i in range(steady):
        check(
            comm.send_forward_recv_backward(_message("forward", stage, warmup + i), SHAPE, last),
            "backward",
            i,
        )
        if i == steady - 1:
            comm.send_backward(_message("backward", stage, i), first)
        else:
            check(
                comm.send_backward_recv_forward(_message("backward", stage, i), SHAPE, first),
                "forward",
                warmup + i + 1,
            )
    for i in range(steady, micro_batches):
        check(comm.recv_backward(SHAPE, last), "backward", i)
        comm.send_backward(_message("backward", stage, i), first)
    return stage, received


def test_communicator_strict_order_delivers_everything():
    results = run_distributed(
        communicate_1f1b, len(LAUNCH_OF), MICRO_BATCHES, timeout=RUN_TIMEOUT, env=STRICT
    )
    for stage, received in results:
        kinds = ([] if stage == 0 else ["forward"]) + (
            [] if stage == len(STAGES) - 1 else ["backward"]
        )
        assert sorted(received) == sorted((k, m) for k in kinds for m in range(MICRO_BATCHES))


def test_communicator_previous_order_hangs_in_strict_mode(capfd):
    with pytest.raises(DistributedTimeout):
        run_distributed(
            communicate_1f1b,
            len(LAUNCH_OF),
            MICRO_BATCHES,
            previous_order=True,
            timeout=COMMUNICATOR_HANG_TIMEOUT,
            env=STRICT,
            stuck_in="_exchange",
        )
    _assert_stuck_in_exchange(capfd, len(LAUNCH_OF))


def _assert_stuck_in_exchange(capfd, world):
    """No process is left, and just before the kill every rank dumped a stack stuck posting a
    boundary operation (not merely slow somewhere else)."""
    assert not multiprocessing.active_children()
    err = capfd.readouterr().err
    stuck = [d for d in err.split("Thread 0x")[1:] if "in _exchange" in d]
    assert len(stuck) == world, err[-3000:]


def write(tmp_path, name):
    world, stages = PLANS[name]
    model = model_from_dict(MODEL)
    pipelines = [
        {"micro_batch_size": MICRO_BATCH, "num_microbatches": MICRO_BATCHES, "stages": stages}
    ]
    plan = build_plan(cpu_cluster(world), model, MICRO_BATCH * MICRO_BATCHES, pipelines)
    path = tmp_path / f"{name}.json"
    save_plan(plan, path)
    return world, path


@pytest.mark.parametrize("name", sorted(PLANS))
def test_strict_order_trains_like_default(name, tmp_path):
    assert MODEL["seq_length"] * MICRO_BATCH * MODEL["hidden_size"] * 4 > 10e6  # tens of MB
    world, path = write(tmp_path, name)
    default = run_distributed(train_one_step, world, path, timeout=RUN_TIMEOUT)[0]
    strict = run_distributed(train_one_step, world, path, timeout=RUN_TIMEOUT, env=STRICT)[0]
    print(f"{name}: losses {default['losses']} (default) {strict['losses']} (strict)")
    assert strict == default


def test_previous_order_hangs_in_strict_mode(tmp_path, capfd):
    """The issue's case in training (the many-to-many case: the communicator test above)."""
    world, path = write(tmp_path, "two_stages")
    with pytest.raises(DistributedTimeout):
        run_distributed(
            train_one_step,
            world,
            path,
            previous_order=True,
            timeout=HANG_TIMEOUT,
            env=STRICT,
            stuck_in="_exchange",
        )
    _assert_stuck_in_exchange(capfd, world)
