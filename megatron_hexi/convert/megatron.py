"""Megatron-LM GPT checkpoints <-> megatron-hexi checkpoints, with megatron-core's own parts.

A Megatron-LM save is `DIR/latest_checkpointed_iteration.txt` and `DIR/iter_0000100/` (or
`release/`), in one of two layouts:
- `torch_dist` (megatron-core `dist_checkpointing`, Megatron-LM's default): `metadata.json`,
  `common.pt` with the run's `args`, and the sharded tensors. It is read into a one-device
  megatron-core GPTModel built from those args with megatron-core's local layer spec, whose
  sharded keys are Transformer Engine's (its `sharded_state_dict_keys_map`), so saves of either
  spec load; TE's `_extra_state` entries are left unread. Any TP/PP of the save loads, since
  dist_checkpointing reshards.
- legacy `torch`: `mp_rank_00/model_optim_rng.pt` holding `model`, `args` and `iteration`; read
  for TP = PP = 1 only (merging legacy shards needs each tensor's split rule; a torch_dist save
  of the same run, or Megatron-LM's own converter to TP 1, serves instead).
The export is a torch_dist save of the same one-device model, with `args` that Megatron-LM's
`--use-checkpoint-args` reads, `iteration` and `checkpoint_version` 3.0, so Megatron-LM loads it
under any TP/PP. The one-device model lives in host memory: a 7B model needs about 28 GB.
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any

from megatron_hexi.checkpoint_files import megatron_lm_layout
from planner.errors import SpecError
from planner.models import ModelSpec, model_from_dict

if TYPE_CHECKING:
    import torch

TRACKER = "latest_checkpointed_iteration.txt"
LEGACY_FILE = os.path.join("mp_rank_00", "model_optim_rng.pt")


def iteration_dir(load: str, step: int | None) -> tuple[str, int]:
    """(folder of the iteration to read, its iteration number; 0 for `release`)."""
    if not os.path.isdir(load):
        raise SpecError(f"--load {load}: no such folder")
    if step is None:
        tracker = os.path.join(load, TRACKER)
        if not os.path.isfile(tracker):
            raise SpecError(
                f"--load {load}: no {TRACKER} (not a Megatron-LM save; or give --ckpt-step)"
            )
        with open(tracker) as f:
            text = f.read(64).strip()
        if text == "release":
            return os.path.join(load, "release"), 0
        if not text.isdigit():
            raise SpecError(f"{tracker}: {text[:32]!r} is neither an iteration nor 'release'")
        step = int(text)
    folder = os.path.join(load, f"iter_{step:07d}")
    if not os.path.isdir(folder):
        raise SpecError(
            f"--load {load}: no iteration {step} ({os.path.basename(folder)} is missing)"
        )
    return folder, step


def layout_of(folder: str) -> str:
    """'torch_dist' or 'torch' (legacy, TP = PP = 1), or a one-line refusal."""
    layout = megatron_lm_layout(folder)
    if layout == "torch" and not os.path.isfile(os.path.join(folder, LEGACY_FILE)):
        shards = sorted(n for n in os.listdir(folder) if n.startswith("mp_rank_"))
        raise SpecError(
            f"{folder}: a legacy checkpoint saved with tensor or pipeline parallelism "
            f"({', '.join(shards[:4])}); only TP = PP = 1 legacy saves are read: convert it to "
            f"torch_dist (Megatron-LM --ckpt-convert-format torch_dist) first"
        )
    if layout is None:
        raise SpecError(
            f"{folder}: neither a torch_dist (metadata.json) nor a legacy torch checkpoint"
        )
    return layout


def _arg(args: Any, name: str, default: Any = None) -> Any:
    return getattr(args, name, default)


def model_fields(args: Any) -> dict[str, Any]:
    """Model-spec fields (Megatron's names) from a Megatron-LM run's `args`."""
    problems = []
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        if not isinstance(_arg(args, name), int):
            problems.append(f"checkpoint args: {name} is missing")
    vocab = _arg(args, "padded_vocab_size") or _arg(args, "vocab_size")
    if not isinstance(vocab, int):
        problems.append("checkpoint args: padded_vocab_size is missing")
    for name, bad in (
        ("num_experts", lambda v: v not in (None, 0, 1)),
        ("qk_layernorm", bool),
        ("multi_latent_attention", bool),
        ("apply_query_key_layer_scaling", bool),
        ("rotary_interleaved", bool),
    ):
        if bad(_arg(args, name)):
            problems.append(f"checkpoint args: {name} {_arg(args, name)!r} is not supported")
    positions = _arg(args, "position_embedding_type", "learned_absolute")
    if positions not in ("rope", "learned_absolute"):
        problems.append(f"checkpoint args: position_embedding_type {positions!r} is not supported")
    if problems:
        raise SpecError(problems)
    heads = args.num_attention_heads
    swiglu = bool(_arg(args, "swiglu", False))
    ffn = _arg(args, "ffn_hidden_size") or 4 * args.hidden_size
    fields: dict[str, Any] = {
        "num_layers": args.num_layers,
        "hidden_size": args.hidden_size,
        "ffn_hidden_size": ffn,
        "num_attention_heads": heads,
        "num_query_groups": (
            _arg(args, "num_query_groups") if _arg(args, "group_query_attention") else heads
        ),
        "vocab_size": vocab,
        "seq_length": args.seq_length,
        "swiglu": swiglu,
        "untie_embeddings_and_output_weights": bool(
            _arg(args, "untie_embeddings_and_output_weights", False)
        ),
        "normalization": _arg(args, "normalization", "LayerNorm"),
        "norm_epsilon": float(_arg(args, "norm_epsilon", 1e-5)),
        "position_embedding_type": positions,
        "add_bias_linear": bool(_arg(args, "add_bias_linear", True)),
        "add_qkv_bias": bool(_arg(args, "add_qkv_bias", False)),
        "init_method_std": float(_arg(args, "init_method_std", 0.02)),
    }
    if positions == "rope":
        fields["rotary_base"] = int(_arg(args, "rotary_base", 10000))
        if _arg(args, "use_rope_scaling", False):
            fields["rope_scaling"] = True
            fields["rope_scaling_factor"] = float(_arg(args, "rope_scaling_factor", 8.0))
    else:
        fields["max_position_embeddings"] = _arg(args, "max_position_embeddings") or args.seq_length
    kv = _arg(args, "kv_channels")
    if kv and kv != args.hidden_size // heads:
        fields["kv_channels"] = kv
    return fields


def megatron_args(model: ModelSpec, iteration: int) -> argparse.Namespace:
    """The model part of a Megatron-LM run's args, as `--use-checkpoint-args` reads them."""
    return argparse.Namespace(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        group_query_attention=model.num_query_groups != model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.head_dim,
        padded_vocab_size=model.vocab_size,
        seq_length=model.seq_length,
        max_position_embeddings=model.position_rows or model.seq_length,
        position_embedding_type=model.position_embedding_type,
        rotary_base=model.rotary_base,
        use_rope_scaling=model.rope_scaling,
        rope_scaling_factor=model.rope_scaling_factor,
        rotary_interleaved=False,
        normalization=model.normalization,
        norm_epsilon=model.norm_epsilon,
        swiglu=model.swiglu,
        add_bias_linear=model.add_bias_linear,
        add_qkv_bias=model.add_qkv_bias,
        untie_embeddings_and_output_weights=model.untie_embeddings_and_output_weights,
        init_method_std=model.init_method_std,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        iteration=iteration,
        ckpt_format="torch_dist",
    )


def _one_process_group() -> bool:
    """A one-rank gloo group and megatron-core's parallel state (TP = PP = 1), if none exists."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_hexi.patches import apply_conversion_patches

    apply_conversion_patches()
    made = False
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        made = True
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)
    return made


def gpt_model(model: ModelSpec, dtype: torch.dtype) -> Any:
    """megatron-core's one-device GPTModel of `model`, with its local layer spec, on the CPU."""
    import torch
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.head_dim,
        normalization=model.normalization,
        layernorm_epsilon=model.norm_epsilon,
        gated_linear_unit=model.swiglu,
        activation_func=F.silu if model.swiglu else F.gelu,
        add_bias_linear=model.add_bias_linear,
        add_qkv_bias=model.add_qkv_bias,
        init_method_std=model.init_method_std,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True,
        perform_initialization=False,
        persist_layer_norm=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization=model.normalization),
        vocab_size=model.vocab_size,
        max_sequence_length=model.position_rows or model.seq_length,
        share_embeddings_and_output_weights=not model.untie_embeddings_and_output_weights,
        position_embedding_type=model.position_embedding_type,
        rotary_base=model.rotary_base,
        rope_scaling=model.rope_scaling,
        rope_scaling_factor=model.rope_scaling_factor,
    )


# Transformer Engine's fused-norm names -> the local spec's (a legacy TE save holds TE's names)
TE_NORMS = {
    "self_attention.linear_qkv.layer_norm_": "input_layernorm.",
    "mlp.linear_fc1.layer_norm_": "pre_mlp_layernorm.",
}


def _local_names(state: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in state.items():
        for te, local in TE_NORMS.items():
            if te in k:
                k = k.replace(te, local)
        out[k] = v
    return out


def _canonical(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The parameters of a one-device model's state dict (no `_extra_state`, no buffers)."""
    import torch

    return {
        k: v
        for k, v in state.items()
        if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")
    }


def read_megatron(load: str, step: int | None) -> tuple[ModelSpec, dict[str, torch.Tensor], int]:
    """(ModelSpec, {canonical name: tensor}, iteration) of a Megatron-LM GPT save."""
    import torch

    folder, iteration = iteration_dir(load, step)
    layout = layout_of(folder)
    _one_process_group()
    if layout == "torch":
        saved = torch.load(
            os.path.join(folder, LEGACY_FILE), map_location="cpu", weights_only=False
        )
        args, state = saved.get("args"), saved.get("model")
        if args is None or not isinstance(state, dict):
            raise SpecError(
                f"{folder}/{LEGACY_FILE}: no 'args' and 'model' (not a Megatron-LM save)"
            )
    else:
        from megatron.core import dist_checkpointing

        args = dist_checkpointing.load_common_state_dict(folder).get("args")
        if args is None:
            raise SpecError(f"{folder}/common.pt: no 'args' (not a Megatron-LM save)")
    fields = model_fields(args)
    fields["name"] = os.path.basename(os.path.normpath(load))
    model = model_from_dict(fields, f"{folder}: args")
    dtype = torch.bfloat16 if _arg(args, "bf16", False) else torch.float32
    net = gpt_model(model, dtype)
    if layout == "torch_dist":
        from megatron.core import dist_checkpointing

        loaded = dist_checkpointing.load({"model": net.sharded_state_dict()}, folder)
        state = loaded["model"]
    missing, unexpected = net.load_state_dict(_local_names(state), strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    unexpected = [k for k in unexpected if not k.endswith("_extra_state")]
    if missing:
        raise SpecError(f"{folder}: tensors missing from the checkpoint: {missing[:4]}")
    if unexpected:
        raise SpecError(f"{folder}: tensors the model of its args does not have: {unexpected[:4]}")
    canon = {k: v.detach().clone() for k, v in _canonical(net.state_dict()).items()}
    return model, canon, iteration


def write_megatron(
    output: str, model: ModelSpec, canon: dict[str, torch.Tensor], iteration: int | None
) -> str:
    """A torch_dist Megatron-LM save of `canon` in `output`; returns the iteration folder
    (`release/` for None, a params-only checkpoint, as Megatron-LM names one)."""
    from megatron.core import dist_checkpointing

    _one_process_group()
    dtype = next(iter(canon.values())).dtype
    net = gpt_model(model, dtype)
    missing, unexpected = net.load_state_dict(canon, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise SpecError(f"export: tensors do not match the model: {(missing + unexpected)[:4]}")
    name = "release" if iteration is None else f"iter_{iteration:07d}"
    folder = os.path.join(output, name)
    os.makedirs(folder)
    state = {
        "model": net.sharded_state_dict(),
        "args": megatron_args(model, iteration or 0),
        "iteration": iteration or 0,
        "checkpoint_version": 3.0,
    }
    try:
        dist_checkpointing.save(state, folder)
    finally:
        _stop_writer_manager()
    with open(os.path.join(output, TRACKER), "w") as f:
        f.write("release" if iteration is None else str(iteration))
    return folder


def _stop_writer_manager() -> None:
    """Stop the manager process megatron-core's torch_dist writer starts for its results queue
    (filesystem_async._get_write_results_queue, kept for the process's life). A process that
    ends with os._exit (a forked test rank) skips the exit handler that would stop it, and the
    manager would outlive it."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    queue = filesystem_async._results_queue
    manager = getattr(queue, "_manager", None)
    if manager is not None:
        manager.shutdown()
    filesystem_async._results_queue = None


def import_megatron(
    load: str, output: str, step: int | None = None, overwrite: bool = False
) -> tuple[ModelSpec, str, str]:
    """A Megatron-LM save -> params-only checkpoint in `output` plus `output/model.yaml`."""
    import yaml

    from megatron_hexi.checkpoint import save_params_only
    from megatron_hexi.output_folder import check_output, replaced_folder

    out = check_output(os.fspath(output), "--output", overwrite, [("--load", load)])
    model, canon, iteration = read_megatron(load, step)
    fields = {k: v for k, v in model.to_dict().items() if k != "name"}
    text = f"# planner model spec of {load} (hexi-convert import-megatron)\n" + yaml.safe_dump(
        fields, sort_keys=False
    )
    with replaced_folder(out, "--output") as staging:
        final = save_params_only(
            staging,
            model,
            canon,
            extra={"imported_from": os.path.abspath(load), "megatron_iteration": iteration},
        )
        with open(os.path.join(staging, "model.yaml"), "w") as f:
            f.write(text)
    return (
        model,
        os.path.join(out, os.path.relpath(final, staging)),
        os.path.join(out, "model.yaml"),
    )


def export_megatron(
    load: str, output: str, step: int | None = None, overwrite: bool = False
) -> tuple[ModelSpec, str]:
    """Any megatron-hexi checkpoint -> a torch_dist Megatron-LM save in `output`."""
    from megatron_hexi.checkpoint import read_full_model
    from megatron_hexi.output_folder import check_output, replaced_folder

    out = check_output(os.fspath(output), "--output", overwrite, [("--load", load)])
    ckpt, model, canon = read_full_model(load, step)
    with replaced_folder(out, "--output") as staging:
        release = os.path.basename(os.path.normpath(ckpt.dir)) == "release"
        folder = write_megatron(staging, model, canon, None if release else ckpt.iteration)
    return model, os.path.join(out, os.path.relpath(folder, staging))
