"""`hexi-convert verify`: the runtime's forward under a plan against `transformers`' on the same
random tokens, so that a user can trust a conversion under their own layout.

The plan's ranks run on this machine, one process each, with the plan's stages and shards; only
the batch is cut down: every pipeline runs one sample of `--seq-length` tokens (default: the
model's, at most 256), so a plan made for a large global batch checks in seconds. The processes
are forked from a forkserver that imported torch and the runtime once (each process importing
them itself costs seconds per rank, and the ranks of a plan outnumber a small machine's cores);
each takes the caller's environment as it is at the launch, as a spawned process would. They
meet at a TCP store the parent holds from the start (no port is picked and released). Launch
rank 0 gathers the logits; the parent runs transformers' model in fp32 on the same tokens and
prints the largest logit difference relative to the largest logit.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import traceback
from typing import TYPE_CHECKING, Any

from planner.errors import SpecError

if TYPE_CHECKING:  # torch is imported where used: `hexi-convert --help` stays fast
    import torch

TOLERANCE = 1e-5  # fp32 on both sides; the tests see 2-3e-6 on tiny models
DEFAULT_MAX_TOKENS = 256
# What the forkserver imports before it forks the ranks. A server already running in this process
# (started by an earlier launch) is used as it is.
PRELOAD = [
    "torch",
    "torch.distributed",
    "megatron.core",
    "megatron_hexi.arguments",
    "megatron_hexi.checkpoint",
    "megatron_hexi.inference",
    "megatron_hexi.training",
]


def verification_plan(plan_dict: dict[str, Any], seq_length: int) -> dict[str, Any]:
    """The plan's layout with one sample per pipeline of `seq_length` tokens, no estimate."""
    out = {k: v for k, v in plan_dict.items() if k != "estimate"}
    out["pipelines"] = [
        {**p, "micro_batch_size": 1, "num_microbatches": 1} for p in plan_dict["pipelines"]
    ]
    out["training"] = {**plan_dict["training"], "global_batch_size": len(out["pipelines"])}
    out["model"] = {**plan_dict["model"], "seq_length": seq_length}
    return out


def _rank(
    local: int,
    world: int,
    plan_path: str,
    load: str,
    device: str,
    port: int,
    tokens_path: str,
    out: str,
    environ: dict[str, str],
) -> None:
    """One rank: the runtime's model under the plan, loaded, one forward pass. It takes the
    caller's environment `environ` (a forked process has the server's), then its identity, in
    its own environment only (the caller's stays as it was)."""
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(RANK=str(local), LOCAL_RANK=str(local), WORLD_SIZE=str(world))
    try:
        import torch
        import torch.distributed as dist

        from megatron_hexi import checkpoint
        from megatron_hexi.arguments import parse_args, run_config
        from megatron_hexi.distributed import init_distributed
        from megatron_hexi.inference import forward_logits
        from megatron_hexi.training import Trainer
        from planner.plan import load_plan

        torch.set_num_threads(1)
        args = parse_args(
            [
                "--hetero-plan-path",
                plan_path,
                "--hetero-device",
                device,
                "--mock-data",
                "--train-iters",
                "1",
                "--lr",
                "0",
                "--load",
                load,
            ]
        )
        plan, config = load_plan(plan_path), run_config(args)
        timeout = datetime.timedelta(minutes=config.runtime.distributed_timeout_minutes)
        store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timeout)
        backend = "nccl" if device == "cuda" else "gloo"
        dist.init_process_group(backend, store=store, rank=local, world_size=world, timeout=timeout)
        trainer = Trainer(plan, config, init_distributed(plan, config))
        checkpoint.load(trainer, config.checkpoint)
        logits = forward_logits(trainer, torch.load(tokens_path))
        if logits is not None:
            torch.save(logits, os.path.join(out, "logits.pt"))
        dist.destroy_process_group()
    except BaseException as e:  # the parent reports it: one line per failing rank
        with open(os.path.join(out, f"error.{local}"), "w") as f:
            f.write(f"{type(e).__name__}: {e}" if str(e) else traceback.format_exc(limit=1))
        raise SystemExit(1)


def runtime_logits(
    plan_path: str, load: str, device: str, tokens: torch.Tensor, world: int, timeout_s: float
) -> torch.Tensor:
    """Launch `world` ranks on this machine and return launch rank 0's logits."""
    import multiprocessing

    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="hexi-verify-") as out:
        tokens_path = os.path.join(out, "tokens.pt")
        torch.save(tokens, tokens_path)
        store = dist.TCPStore(
            "127.0.0.1",
            0,
            None,
            True,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
        multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
        context = mp.start_processes(
            _rank,
            args=(world, plan_path, load, device, store.port, tokens_path, out, dict(os.environ)),
            nprocs=world,
            join=False,
            start_method="forkserver",
        )
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
        try:
            while not context.join(timeout=1.0):
                if datetime.datetime.now() > deadline:
                    raise SpecError(f"verify: the ranks did not finish within {timeout_s:g} s")
        except mp.ProcessRaisedException as e:
            raise SpecError(f"verify: a rank failed: {str(e).strip().splitlines()[-1]}")
        except mp.ProcessExitedException:
            errors = sorted(n for n in os.listdir(out) if n.startswith("error."))
            if errors:
                with open(os.path.join(out, errors[0])) as f:
                    first = f.read().strip().splitlines()[-1]
                raise SpecError(f"verify: rank {errors[0].split('.')[1]}: {first}")
            raise SpecError("verify: a rank exited without saying why")
        finally:
            for p in context.processes:
                if p.is_alive():
                    p.kill()
            del store
        return torch.load(os.path.join(out, "logits.pt"))


def transformers_logits(hf_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # stderr keeps to this command's own lines
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(tokens).logits.float()


def verify(
    hf_dir: str,
    load: str,
    plan_path: str,
    device: str = "cpu",
    seq_length: int | None = None,
    seed: int = 0,
    timeout_s: float = 600.0,
) -> float:
    """Largest |runtime logit - transformers logit| / largest |transformers logit|."""
    import torch

    from megatron_hexi.convert.families import model_fields
    from megatron_hexi.hf_files import read_config
    from planner.inputs import read_json
    from planner.plan import load_plan, plan_from_dict, save_plan

    if not os.path.isdir(hf_dir):
        raise SpecError(f"--hf-dir {hf_dir}: no such folder")
    plan = load_plan(plan_path)
    theirs = model_fields(read_config(os.path.realpath(hf_dir)))
    ours = plan.model
    different = [k for k, v in theirs.items() if k != "seq_length" and getattr(ours, k, None) != v]
    if different:
        k = different[0]
        raise SpecError(
            f"--hetero-plan-path {plan_path}: model.{k} is {getattr(ours, k)!r}, "
            f"{hf_dir}/config.json gives {theirs[k]!r}"
        )
    length = seq_length or min(ours.seq_length, DEFAULT_MAX_TOKENS)
    small = plan_from_dict(verification_plan(read_json(plan_path, "plan"), length))
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, ours.vocab_size, (small.global_batch_size, length), generator=g)
    with tempfile.TemporaryDirectory(prefix="hexi-verify-plan-") as d:
        path = os.path.join(d, "plan.json")
        save_plan(small, path)
        got = runtime_logits(path, load, device, tokens, small.world_size, timeout_s)
    reference = transformers_logits(hf_dir, tokens)
    return ((got - reference).abs().max() / reference.abs().max()).item()
