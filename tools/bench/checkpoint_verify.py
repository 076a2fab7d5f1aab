"""What checkpoint verification costs: --load time with and without it, same run, CPU.

    python tools/bench/checkpoint_verify.py [--layers 4] [--hidden 512] [--vocab 16384] [--rounds 5]

What is measured. One rank trains one step of a GPT model (fp32, Adam) and saves it (one rank
file: master weights and both Adam moments). Then, in one process group each, the checkpoint is
loaded `--rounds` times with verification and as many times without (megatron_hexi.checkpoint.load
with verify=False: no checksums, no NaN/inf check, no rank-file metadata check), alternating which
goes first to cancel drift:
  same plan   1 rank reads the file it wrote (the common resume);
  resharded   2 ranks (one TP=2 stage) read halves of the tensors; verification checks the
              checksum blocks that overlap what a rank reads: half of each tensor split along its
              first dimension, every block of one split along an inner dimension (each row).
A load's time is the slowest rank's, from a barrier; the table shows medians over the rounds, and
the bytes each rank read and checked in one more verified load.
Then the parts of verification are timed alone over every tensor of the file: reading it
(safetensors get_tensor), CRC-32 per block as recorded and at other block sizes, and the finite
check (numpy min and max, what the verification threads run: torch's ops would start a team of
intra-op threads in each), with torch.aminmax, blake2b-128, sha256 and torch.isfinite(t).all()
for comparison (why not those). With the bytes a resharded rank would check at each block size
(computed from the plan, not timed), this is how the block size was chosen: small blocks slow
CRC-32 down, large ones make a rank check more than it reads.

The file is in the page cache (just written, then read once before timing), so the load times are
memory and CPU bound: the worst case for the ratio. Reading from a disk adds the same I/O time to
both variants. Wall times need an idle machine: the load average is printed before and after.
"""

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported, here and in the ranks

import argparse  # noqa: E402
import shlex  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# The repository root first (as under `python -m pytest` from it): tests/planner would otherwise
# shadow the planner package, here and in the ranks.
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent), str(ROOT / "tests")]

import yaml  # noqa: E402

GLOBAL_BATCH = 2


def _setup(plan, checkpoint):
    """(RunConfig, device): one step of mock data, no dropout, with `checkpoint` (a
    CheckpointConfig); the process group initialised."""
    import torch

    torch.set_num_threads(1)
    from megatron_hexi.config import (
        DataConfig,
        DropoutConfig,
        LoggingConfig,
        OptimizerConfig,
        RunConfig,
        TrainingConfig,
    )
    from megatron_hexi.training import init_distributed

    config = RunConfig(
        training=TrainingConfig(train_iters=1, seed=1234),
        optimizer=OptimizerConfig(lr=1e-3),
        dropout=DropoutConfig(attention_dropout=0.0, hidden_dropout=0.0),
        data=DataConfig(mock_data=True),
        checkpoint=checkpoint,
        logging=LoggingConfig(log_interval=1000),
    )
    return config, init_distributed(plan, config)


def save_worker(plan, ckpt_dir):
    """One training step, then the save at the end of the run; returns the save's seconds."""
    import contextlib
    import io

    from megatron_hexi.config import CheckpointConfig
    from megatron_hexi.training import run

    config, device = _setup(plan, CheckpointConfig(save=str(ckpt_dir)))
    with contextlib.redirect_stdout(io.StringIO()):
        trainer, _ = run(plan, config, device)
    return [e for e in trainer.checkpoint_events if "save_iteration" in e][0]["seconds"]


def load_worker(plan, ckpt_dir, rounds):
    """{verify: [seconds per load], "bytes": (read, checked) by this rank in a verified load}:
    the slowest rank's time of each load."""
    import contextlib
    import io

    import torch
    import torch.distributed as dist

    from megatron_hexi import checkpoint
    from megatron_hexi.config import CheckpointConfig
    from megatron_hexi.training import Trainer

    config, device = _setup(plan, CheckpointConfig(load=str(ckpt_dir)))
    trainer = Trainer(plan, config, device)
    load = config.checkpoint
    times = {False: [], True: []}
    with contextlib.redirect_stdout(io.StringIO()):
        checkpoint.load(trainer, load, verify=True)  # warm-up: page cache, allocator
        for r in range(rounds):
            for verify in (False, True) if r % 2 == 0 else (True, False):
                dist.barrier()
                start = time.perf_counter()
                checkpoint.load(trainer, load, verify=verify)
                t = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                times[verify].append(t.item())
        opened, plain = [], checkpoint.Checkpoint

        class Counted(plain):
            def __init__(self, *a, **k):
                super().__init__(*a, **k)
                opened.append(self)

        checkpoint.Checkpoint = Counted
        try:
            checkpoint.load(trainer, load, verify=True)
        finally:
            checkpoint.Checkpoint = plain
    times["bytes"] = (opened[0].read_bytes, opened[0].checked_bytes)
    return times


def parts(ckpt_dir, repeats=3):
    """Best-of-`repeats` seconds of each part of verification over every tensor of the files."""
    import hashlib

    import torch
    from safetensors import safe_open

    from megatron_hexi.checkpoint import BLOCK_BYTES, Checkpoint, block_checksums, non_finite

    torch.set_num_threads(1)
    with Checkpoint(str(ckpt_dir)) as ck:
        keys = [(fname, row["key"]) for fname, rows in ck.meta["files"].items() for row in rows]
        directory = ck.dir
    handles = {f: safe_open(os.path.join(directory, f), framework="pt") for f, _ in keys}
    tensors = [handles[f].get_tensor(k) for f, k in keys]
    size = sum(t.numel() * t.element_size() for t in tensors)

    def flat(t):
        return t.reshape(-1).view(torch.uint8).numpy()

    jobs = {
        "read (get_tensor)": lambda: [handles[f].get_tensor(k) for f, k in keys],
        f"crc32 per {BLOCK_BYTES >> 10} KiB (recorded)": lambda: [
            block_checksums(t) for t in tensors
        ],
        **{
            f"crc32 per {kib} KiB": (
                lambda kib=kib: [block_checksums(t, kib << 10) for t in tensors]
            )
            for kib in (16, 64, 256, 4096)
            if kib << 10 != BLOCK_BYTES
        },
        "crc32 whole tensors": lambda: [
            block_checksums(t, max(1, t.numel() * t.element_size())) for t in tensors
        ],
        "finite check (numpy min, max)": lambda: [non_finite(t) for t in tensors],
        "torch.aminmax": lambda: [torch.aminmax(t) for t in tensors],
        "blake2b-128": lambda: [hashlib.blake2b(flat(t), digest_size=16).digest() for t in tensors],
        "sha256": lambda: [hashlib.sha256(flat(t)).digest() for t in tensors],
        "isfinite(t).all()": lambda: [torch.isfinite(t).all() for t in tensors],
    }
    out = {}
    for name, job in jobs.items():
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            job()
            best = min(best, time.perf_counter() - start)
        out[name] = best
    return size, out


def checked_by_block_size(ckpt_dir, plan, sizes=(64 << 10, 256 << 10, 1 << 20, 4 << 20)):
    """{block bytes: [(bytes read, bytes checked) per rank]} of a verified load under the plan:
    each rank's pieces, the blocks of the stored tensors they overlap, each block counted once."""
    import numpy as np

    from megatron_hexi.checkpoint import (
        ITEMSIZE,
        Checkpoint,
        blocks_bytes,
        overlapping_blocks,
        tensor_bytes,
    )
    from planner.layout import rank_param_shards

    with Checkpoint(str(ckpt_dir)) as ck:  # the index only: nothing is read
        index = ck.index
    out = {}
    for block in sizes:
        out[block] = []
        for rank in range(plan.world_size):
            read = checked = 0
            for shard in rank_param_shards(plan, rank):
                for kind in ("param", "exp_avg", "exp_avg_sq"):
                    for _, row in index.get((kind, shard.name), []):
                        shape = list(row["shape"])
                        shape[row["dim"]] = row["length"]
                        itemsize = ITEMSIZE[row["dtype"]]
                        hit = np.zeros(-(-tensor_bytes(row) // block), dtype=bool)
                        for piece in shard.pieces:
                            lo = max(piece.global_start, row["start"]) - row["start"]
                            hi = (
                                min(piece.global_start + piece.length, row["start"] + row["length"])
                                - row["start"]
                            )
                            if lo < hi:
                                read += tensor_bytes(row) * (hi - lo) // row["length"]
                                hit |= overlapping_blocks(
                                    shape, itemsize, row["dim"], lo, hi, block
                                )
                        checked += blocks_bytes(np.flatnonzero(hit), block, tensor_bytes(row))
            out[block].append((read, checked))
    return out


def build_plans(directory, model_fields):
    """(model, {case: (Plan, world size)}); the ranks get the Plan objects (no plan files)."""
    from planner.models import load_model
    from planner.plan import build_plan

    sys.path.insert(0, str(ROOT / "tests"))
    from runtime.plans import cpu_cluster

    (directory / "model.yaml").write_text(yaml.safe_dump(model_fields))
    model = load_model(str(directory / "model.yaml"))
    plans = {}
    for name, world, ranks in (("same plan", 1, [0]), ("resharded", 2, [0, 1])):
        pipelines = [
            {
                "micro_batch_size": 1,
                "num_microbatches": GLOBAL_BATCH,
                "stages": [{"ranks": ranks, "layers": [0, model.num_layers]}],
            }
        ]
        plans[name] = (build_plan(cpu_cluster(world), model, GLOBAL_BATCH, pipelines), world)
    return model, plans


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--rounds", type=int, default=5, help="loads of each variant")
    p.add_argument("--timeout", type=float, default=600, help="seconds per job (harness)")
    a = p.parse_args(argv)
    import checkpoint_verify as me  # the ranks find the workers by this module's name
    from harness import run_distributed

    fields = {
        "name": "bench-ckpt",
        "num_layers": a.layers,
        "hidden_size": a.hidden,
        "ffn_hidden_size": 4 * a.hidden,
        "num_attention_heads": 8,
        "num_query_groups": 8,
        "vocab_size": a.vocab,
        "seq_length": 128,
    }
    print("$ " + " ".join(shlex.quote(x) for x in [sys.executable, *sys.argv]), flush=True)
    load0 = os.getloadavg()
    print(
        f"load average {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f} on {os.cpu_count()} CPUs",
        flush=True,
    )
    start = time.monotonic()
    env = {"OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="hexi-ckpt-verify-") as tmp:
        tmp = Path(tmp)
        model, plans = build_plans(tmp, fields)
        ckpt = tmp / "ckpt"
        save_s = run_distributed(
            me.save_worker, 1, plans["same plan"][0], ckpt, timeout=a.timeout, env=env, fresh=True
        )[0]
        size, part = parts(ckpt)
        print(
            f"model {a.layers}L h{a.hidden} ffn{4 * a.hidden} vocab {a.vocab}: checkpoint "
            f"{size / 1e6:.0f} MB (fp32 weights + Adam moments, one rank file), saved in "
            f"{save_s:.2f} s with checksums",
            flush=True,
        )
        ratios = {}
        print(
            f"\n{'case':<11} {'ranks':>5} {'plain_s':>8} {'verified_s':>10} {'ratio':>6}  "
            f"MB read / checked per rank"
        )
        for case, (plan, world) in plans.items():
            results = run_distributed(
                me.load_worker, world, plan, ckpt, a.rounds, timeout=a.timeout, env=env, fresh=True
            )
            times = results[0]
            plain, verified = (statistics.median(times[v]) for v in (False, True))
            ratios[case] = verified / plain
            per_rank = ", ".join(
                f"{r['bytes'][0] / 1e6:.0f} / {r['bytes'][1] / 1e6:.0f}" for r in results
            )
            print(
                f"{case:<11} {world:>5} {plain:8.3f} {verified:10.3f} {ratios[case]:5.2f}x  "
                f"{per_rank}",
                flush=True,
            )
        by_size = checked_by_block_size(ckpt, plans["resharded"][0])
    print(f"\nparts, one thread, over all {size / 1e6:.0f} MB (best of 3):")
    for name, seconds in part.items():
        print(f"  {name:<30} {seconds:7.3f} s  {size / seconds / 1e9:6.2f} GB/s")
    print("\nresharded load, MB read / checked per rank, by block size (computed):")
    for block, per_rank in by_size.items():
        print(
            f"  {block >> 10:>5} KiB  "
            + ", ".join(f"{r / 1e6:.0f} / {c / 1e6:.0f}" for r, c in per_rank)
        )
    load1 = os.getloadavg()
    print(
        f"\nverified / plain load: same plan ratio {ratios['same plan']:.2f}x, resharded ratio "
        f"{ratios['resharded']:.2f}x; total {time.monotonic() - start:.0f} s; load average "
        f"{load0[0]:.2f} -> {load1[0]:.2f} on {os.cpu_count()} CPUs"
    )
    if max(load0[0], load1[0]) > os.cpu_count() * 0.75:
        print(
            "WARNING: the machine was busy with other work; wall times are inflated and noisy "
            "(rerun when idle)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
