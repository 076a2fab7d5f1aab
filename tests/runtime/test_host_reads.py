"""A training step reads values back from the device once, at its end (megatron_hexi.
step_accounting): counted over real steps on CPU, where every read of a tensor's value by the host
still passes through the same calls it does on CUDA (`aten._local_scalar_dense` under `.item()`,
`float()`, `int()`, `bool()`; `.tolist()`, `.numpy()`; and the CUDA waits). A step that reads the
token count early, as the runtime once did, is caught."""

import collections
import contextlib
import traceback

import pytest

from harness import run_distributed
from runtime.plans import TWO_STAGES, write_plan
from runtime.workers import BASE_FLAGS

STEPS = 3
# Reads of tensors that live on the host on every device, so never a wait for the GPU:
# megatron-core's RNG tracker compares the CPU generator's state around each dropout region
# (tensor_parallel/random.py, `fork`: torch.get_rng_state() is a CPU tensor under CUDA too).
HOST_TENSORS = {"random.py:fork"}
# Every kind of rank a step has: a two-stage pipeline (a boundary, first and last stages) beside
# a one-rank pipeline that holds the whole model.
PIPELINES = [
    TWO_STAGES[0] | {"micro_batch_size": 2, "num_microbatches": 2},
    {"micro_batch_size": 2, "num_microbatches": 2, "stages": [{"ranks": [2], "layers": [0, 4]}]},
]


@contextlib.contextmanager
def counting_host_reads():
    """Yields a list that collects, for every host read of a tensor value inside the block, the
    innermost frame outside torch that made it ("file:function")."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    sites: list[str] = []

    def record() -> None:
        for frame in reversed(traceback.extract_stack()[:-1]):
            if "/torch/" in frame.filename or frame.name in ("wrapper", "__torch_dispatch__"):
                continue
            sites.append(f"{frame.filename.rsplit('/', 1)[-1]}:{frame.name}")
            return

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                record()
            return func(*args, **(kwargs or {}))

    def counted(original):
        def wrapper(*args, **kwargs):
            record()
            return original(*args, **kwargs)

        return wrapper

    patched = [
        (torch.Tensor, "tolist"),
        (torch.Tensor, "numpy"),
        (torch.cuda, "synchronize"),
        (torch.cuda.Event, "synchronize"),
        (torch.cuda.Stream, "synchronize"),
    ]
    originals = [getattr(owner, name) for owner, name in patched]
    for (owner, name), original in zip(patched, originals):
        setattr(owner, name, counted(original))
    try:
        with Reads():
            yield sites
    finally:
        for (owner, name), original in zip(patched, originals):
            setattr(owner, name, original)


def _count_step_reads(plan_path, defect):
    """Train STEPS steps; per step, the sites of its host reads (every rank)."""
    from megatron_hexi import training
    from megatron_hexi.arguments import parse_args, run_config
    from megatron_hexi.grad_sync import GradientSync
    from planner.plan import load_plan

    if defect == "early_token_read":  # the token count read before dividing, as it once was
        real_sync = GradientSync.sync

        def sync(self, num_tokens):
            real_sync(self, float(num_tokens))

        GradientSync.sync = sync
    per_step = []
    real_step = training.Trainer.train_step

    def train_step(self, iteration):
        with counting_host_reads() as sites:
            out = real_step(self, iteration)
        per_step.append([s for s in sites if s not in HOST_TENSORS])
        return out

    training.Trainer.train_step = train_step
    flags = [f for f in BASE_FLAGS if f not in ("--train-iters", "3")]
    args = parse_args(["--hetero-plan-path", str(plan_path), *flags, "--train-iters", str(STEPS)])
    plan, config = load_plan(args.hetero_plan_path), run_config(args)
    device = training.init_distributed(plan, config)
    training.run(plan, config, device)
    return per_step


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_one_host_read_per_step(distributed_optimizer, tmp_path):
    path = write_plan(
        tmp_path, "reads", "tiny", 3, PIPELINES, use_distributed_optimizer=distributed_optimizer
    )
    per_rank = run_distributed(_count_step_reads, 3, path, None, timeout=300)
    for rank, steps in enumerate(per_rank):
        assert len(steps) == STEPS
        for sites in steps:
            # the one read of what the step reports, at its end
            assert sites == ["training.py:train_step"], (rank, sites)


def test_a_read_inside_the_step_is_caught(tmp_path):
    path = write_plan(tmp_path, "reads", "tiny", 3, PIPELINES)
    per_rank = run_distributed(_count_step_reads, 3, path, "early_token_read", timeout=300)
    for steps in per_rank:
        for sites in steps:
            assert collections.Counter(sites) == {
                "training.py:train_step": 1,
                "test_host_reads.py:sync": 1,
            }, sites
