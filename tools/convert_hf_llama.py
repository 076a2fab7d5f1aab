#!/usr/bin/env python
"""Convert between Hugging Face LlamaForCausalLM safetensors and megatron-hexi checkpoints.

    # HF -> ours: a params-only checkpoint (DIR/release/, pointer "release") and a model YAML
    python tools/convert_hf_llama.py import --hf-dir llama/ --output ckpt/ [--seq-length 4096]
    # (a non-empty --output is refused; --overwrite replaces it whole, as it does for export)
    hexi-plan ... --model ckpt/model.yaml ...          # plan any layout for it
    pretrain_gpt.py --hetero-plan-path plan.json --load ckpt/ ...   # Adam starts fresh

    # ours -> HF: from any checkpoint, saved under any plan
    python tools/convert_hf_llama.py export --load ckpt/ [--ckpt-step N] --output hf/

Mapping (megatron-core names on the left, per layer i; no weight permutation is needed: with
rotary_interleaved=False megatron-core rotates halves exactly like HF's rotate_half):
    embedding.word_embeddings.weight             model.embed_tokens.weight
    decoder.layers.i.input_layernorm.weight      model.layers.i.input_layernorm.weight
    decoder.layers.i.self_attention.linear_qkv   q_proj, k_proj, v_proj interleaved per query
        .weight                                  group g: [q heads of g; k_g; v_g] (GQA)
    decoder.layers.i.self_attention.linear_proj  o_proj
    decoder.layers.i.pre_mlp_layernorm.weight    post_attention_layernorm
    decoder.layers.i.mlp.linear_fc1.weight       [gate_proj; up_proj] (SwiGLU: silu(gate) x up)
    decoder.layers.i.mlp.linear_fc2.weight       down_proj
    decoder.final_layernorm.weight               model.norm.weight
    output_layer.weight                          lm_head.weight (absent when tied)
Tensors keep their dtype (a bf16 model is stored bf16; loading casts to the training dtype), so
HF -> ours -> HF gives identical tensors. The importer keeps the HF config in the checkpoint's
metadata; the exporter starts from it (or from defaults) and sets the model's fields.
"""

import argparse
import json
import os
import sys

import torch
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from megatron_hexi.hf_files import read_config, read_tensors  # noqa: E402
from megatron_hexi.output_folder import (  # noqa: E402
    check_output,
    replaced_folder,
    write_file_atomically,
)
from planner.errors import SpecError  # noqa: E402
from planner.inputs import is_int, is_number, short  # noqa: E402
from planner.layout import canonical_shards  # noqa: E402
from planner.models import model_from_dict  # noqa: E402

_MISSING = object()


def _int_field(cfg, key, problems, default=_MISSING):
    """cfg[key] as an integer >= 1 (`default` when absent or null), else a problem line."""
    value = cfg.get(key)
    if value is None and default is not _MISSING:
        return default
    if value is None:
        problems.append(f"config.json: {key} is missing")
    elif not is_int(value) or value < 1:
        problems.append(f"config.json: {key} is {short(value)}, expected an integer >= 1")
    else:
        return value
    return None


def _positive_number(cfg, key, default, problems):
    """cfg[key] as a finite number > 0 (`default` when absent), else a problem line."""
    value = cfg.get(key, default)
    if not is_number(value) or value <= 0:
        problems.append(f"config.json: {key} is {short(value)}, expected a finite number > 0")
        return None
    return float(value)


def rope_theta(cfg):
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    for key, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if not isinstance(value, dict):
            raise SpecError(f"config.json: {key} is {short(value)}, expected an object")
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise SpecError(
            f"config.json: rope type {short(kind)} (RoPE scaling) is not supported; only "
            f"plain rotary embeddings are"
        )
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    if not is_number(theta) or theta <= 0 or float(theta) != int(theta):
        raise SpecError(f"config.json: rope_theta is {short(theta)}, expected an integer > 0")
    return int(theta)


def model_fields(cfg, seq_length=None):
    """Planner model-spec fields (Megatron names) of an HF Llama config dict."""
    problems = []
    if cfg.get("model_type", "llama") != "llama":
        problems.append(f"config.json: model_type {cfg.get('model_type')!r}, expected 'llama'")
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"config.json: hidden_act {cfg['hidden_act']!r}, only silu (SwiGLU)")
    for flag in ("attention_bias", "mlp_bias"):
        if cfg.get(flag):
            problems.append(f"config.json: {flag} true is not supported (Llama has no biases)")
    ints = {
        key: _int_field(cfg, key, problems)
        for key in (
            "num_hidden_layers",
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "vocab_size",
        )
    }
    groups = _int_field(cfg, "num_key_value_heads", problems, default=ints["num_attention_heads"])
    head_dim = _int_field(cfg, "head_dim", problems, default=0)
    positions = seq_length or _int_field(cfg, "max_position_embeddings", problems, default=2048)
    eps = _positive_number(cfg, "rms_norm_eps", 1e-6, problems)
    std = cfg.get("initializer_range", 0.02)
    if not is_number(std) or std < 0:
        problems.append(f"config.json: initializer_range is {short(std)}, expected a number >= 0")
    tie = cfg.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        problems.append(f"config.json: tie_word_embeddings is {short(tie)}, expected true/false")
    if problems:
        raise SpecError(problems)
    heads, hidden = ints["num_attention_heads"], ints["hidden_size"]
    fields = {
        "num_layers": ints["num_hidden_layers"],
        "hidden_size": hidden,
        "ffn_hidden_size": ints["intermediate_size"],
        "num_attention_heads": heads,
        "num_query_groups": groups,
        "vocab_size": ints["vocab_size"],
        "seq_length": positions,
        "swiglu": True,
        "untie_embeddings_and_output_weights": not tie,
        "normalization": "RMSNorm",
        "norm_epsilon": eps,
        "rotary_base": rope_theta(cfg),
        "add_bias_linear": False,
        "init_method_std": float(std),
    }
    if head_dim and head_dim != hidden // heads:
        fields["kv_channels"] = head_dim
    return fields


def hf_config(model, base=None):
    """An HF LlamaConfig dict for planner ModelSpec `model` (keeping `base`'s other keys)."""
    cfg = dict(
        base
        or {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "attention_dropout": 0.0,
            "pretraining_tp": 1,
            "use_cache": True,
            "bos_token_id": 1,
            "eos_token_id": 2,
        }
    )
    cfg.pop("rope_scaling", None)
    cfg.update(
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "num_hidden_layers": model.num_layers,
            "hidden_size": model.hidden_size,
            "intermediate_size": model.ffn_hidden_size,
            "num_attention_heads": model.num_attention_heads,
            "num_key_value_heads": model.num_query_groups,
            "vocab_size": model.vocab_size,
            "max_position_embeddings": max(model.seq_length, cfg.get("max_position_embeddings", 0)),
            "rms_norm_eps": model.norm_epsilon,
            # Always written (as transformers writes it): without it readers take
            # hidden_size // num_attention_heads, wrong whenever kv_channels is set.
            "head_dim": model.head_dim,
            "tie_word_embeddings": not model.untie_embeddings_and_output_weights,
            "initializer_range": model.init_method_std,
            "rope_parameters": {"rope_theta": float(model.rotary_base), "rope_type": "default"},
        }
    )
    cfg.pop("rope_theta", None)
    return cfg


def _check_model(model):
    if not model.swiglu or model.normalization != "RMSNorm" or model.add_bias_linear:
        raise SpecError(
            "export: only Llama-style models (SwiGLU, RMSNorm, no biases) map to LlamaForCausalLM"
        )


def hf_to_canonical(hf, model):
    """{canonical name: tensor} from {HF name: tensor}. Every HF tensor must be used."""
    d, hpg, groups = model.head_dim, model.heads_per_group, model.num_query_groups
    hidden, ffn, heads = model.hidden_size, model.ffn_hidden_size, model.num_attention_heads
    used, out = set(), {}
    shapes = {
        "model.embed_tokens.weight": (model.vocab_size, hidden),
        "lm_head.weight": (model.vocab_size, hidden),
        "model.norm.weight": (hidden,),
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (heads * d, hidden),
        "self_attn.k_proj.weight": (groups * d, hidden),
        "self_attn.v_proj.weight": (groups * d, hidden),
        "self_attn.o_proj.weight": (hidden, heads * d),
        "mlp.gate_proj.weight": (ffn, hidden),
        "mlp.up_proj.weight": (ffn, hidden),
        "mlp.down_proj.weight": (hidden, ffn),
    }

    def take(name):
        if name not in hf:
            raise SpecError(f"HF checkpoint: missing tensor {name}")
        shape = shapes[name.split(".", 3)[-1] if name.startswith("model.layers.") else name]
        if tuple(hf[name].shape) != shape:
            raise SpecError(
                f"HF checkpoint: {name} has shape {tuple(hf[name].shape)}, config.json "
                f"gives {shape}"
            )
        used.add(name)
        return hf[name]

    out["embedding.word_embeddings.weight"] = take("model.embed_tokens.weight")
    for i in range(model.num_layers):
        hp, mp = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[mp + "input_layernorm.weight"] = take(hp + "input_layernorm.weight")
        q = take(hp + "self_attn.q_proj.weight")
        k = take(hp + "self_attn.k_proj.weight")
        v = take(hp + "self_attn.v_proj.weight")
        h = q.shape[1]
        q, k, v = q.view(groups, hpg * d, h), k.view(groups, d, h), v.view(groups, d, h)
        out[mp + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], 1).reshape(-1, h)
        out[mp + "self_attention.linear_proj.weight"] = take(hp + "self_attn.o_proj.weight")
        out[mp + "pre_mlp_layernorm.weight"] = take(hp + "post_attention_layernorm.weight")
        out[mp + "mlp.linear_fc1.weight"] = torch.cat(
            [take(hp + "mlp.gate_proj.weight"), take(hp + "mlp.up_proj.weight")], 0
        )
        out[mp + "mlp.linear_fc2.weight"] = take(hp + "mlp.down_proj.weight")
    out["decoder.final_layernorm.weight"] = take("model.norm.weight")
    if model.untie_embeddings_and_output_weights:
        out["output_layer.weight"] = take("lm_head.weight")
    elif "lm_head.weight" in hf:
        if not torch.equal(hf["lm_head.weight"], hf["model.embed_tokens.weight"]):
            raise SpecError(
                "HF checkpoint: tie_word_embeddings is true but lm_head.weight differs "
                "from model.embed_tokens.weight"
            )
        used.add("lm_head.weight")
    unused = sorted(n for n in set(hf) - used if not n.endswith("rotary_emb.inv_freq"))
    if unused:
        raise SpecError(
            f"HF checkpoint: tensors this converter does not map: {unused[:8]}"
            f"{' ...' if len(unused) > 8 else ''}"
        )
    return out


def canonical_to_hf(canon, model):
    """{HF name: tensor} from {canonical name: tensor}."""
    d, hpg, groups = model.head_dim, model.heads_per_group, model.num_query_groups
    out = {"model.embed_tokens.weight": canon["embedding.word_embeddings.weight"]}
    for i in range(model.num_layers):
        hp, mp = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[hp + "input_layernorm.weight"] = canon[mp + "input_layernorm.weight"]
        qkv = canon[mp + "self_attention.linear_qkv.weight"]
        h = qkv.shape[1]
        qkv = qkv.view(groups, (hpg + 2) * d, h)
        out[hp + "self_attn.q_proj.weight"] = qkv[:, : hpg * d].reshape(-1, h).contiguous()
        out[hp + "self_attn.k_proj.weight"] = (
            qkv[:, hpg * d : (hpg + 1) * d].reshape(-1, h).contiguous()
        )
        out[hp + "self_attn.v_proj.weight"] = qkv[:, (hpg + 1) * d :].reshape(-1, h).contiguous()
        out[hp + "self_attn.o_proj.weight"] = canon[mp + "self_attention.linear_proj.weight"]
        out[hp + "post_attention_layernorm.weight"] = canon[mp + "pre_mlp_layernorm.weight"]
        gate, up = canon[mp + "mlp.linear_fc1.weight"].chunk(2, dim=0)
        out[hp + "mlp.gate_proj.weight"] = gate.contiguous()
        out[hp + "mlp.up_proj.weight"] = up.contiguous()
        out[hp + "mlp.down_proj.weight"] = canon[mp + "mlp.linear_fc2.weight"]
    out["model.norm.weight"] = canon["decoder.final_layernorm.weight"]
    if model.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = canon["output_layer.weight"]
    return out


def read_hf_tensors(hf_dir):
    """Every tensor of model.safetensors or of the shards listed in model.safetensors.index.json
    (megatron_hexi.hf_files: regular files inside the folder, each tensor once, floats only)."""
    return read_tensors(os.path.realpath(hf_dir))


def import_hf(hf_dir, output, seq_length=None, model_yaml=None, overwrite=False):
    """HF directory -> params-only checkpoint in `output` (release/) plus a model YAML.
    Returns (ModelSpec, checkpoint directory, YAML path). A non-empty `output` is replaced whole
    with `overwrite`, else refused; so is an existing `model_yaml` outside it."""
    from megatron_hexi.checkpoint import save_params_only

    hf_dir = os.fspath(hf_dir)
    if not os.path.isdir(hf_dir):
        raise SpecError(f"--hf-dir {hf_dir}: no such folder")
    out = check_output(os.fspath(output), "--output", overwrite, [("--hf-dir", hf_dir)])
    yml = os.path.abspath(model_yaml) if model_yaml else os.path.join(out, "model.yaml")
    yml_inside = os.path.commonpath([yml, out]) == out
    if not yml_inside:
        if os.path.commonpath([os.path.realpath(yml), os.path.realpath(hf_dir)]) == (
            os.path.realpath(hf_dir)
        ):
            raise SpecError(f"--model-yaml {model_yaml}: is inside --hf-dir {hf_dir}")
        write_file_atomically(yml, None, "--model-yaml", overwrite)  # only checks
    cfg = read_config(os.path.realpath(hf_dir))
    fields = model_fields(cfg, seq_length)
    fields["name"] = os.path.basename(os.path.normpath(hf_dir))
    model = model_from_dict(fields, "converted model")
    canon = hf_to_canonical(read_hf_tensors(hf_dir), model)
    text = (
        f"# planner model spec of {hf_dir} (tools/convert_hf_llama.py import)\n"
        + yaml.safe_dump({k: v for k, v in fields.items() if k != "name"}, sort_keys=False)
    )
    with replaced_folder(out, "--output") as staging:
        final = save_params_only(
            staging,
            model,
            canon,
            extra={"hf_config": cfg, "imported_from": os.path.abspath(hf_dir)},
        )
        if yml_inside:
            inner = os.path.join(staging, os.path.relpath(yml, out))
            os.makedirs(os.path.dirname(inner), exist_ok=True)
            with open(inner, "w") as f:
                f.write(text)
    if not yml_inside:
        write_file_atomically(yml, text, "--model-yaml", overwrite)
    return model, os.path.join(out, os.path.relpath(final, staging)), yml


def export_hf(load_dir, output, step=None, dtype=None, overwrite=False):
    """Any megatron-hexi checkpoint -> HF model.safetensors + config.json in `output` (a
    non-empty `output` is replaced whole with `overwrite`, else refused)."""
    from safetensors.torch import save_file

    from megatron_hexi.checkpoint import read_full_model

    out = check_output(os.fspath(output), "--output", overwrite, [("--load", os.fspath(load_dir))])
    ckpt, model, canon = read_full_model(load_dir, step)
    _check_model(model)
    hf = canonical_to_hf(canon, model)
    if dtype is not None:
        hf = {k: v.to(dtype) for k, v in hf.items()}
    hf = {k: v.contiguous() for k, v in hf.items()}
    cfg = hf_config(model, ckpt.meta.get("hf_config"))
    cfg["dtype"] = str(next(iter(hf.values())).dtype).replace("torch.", "")
    with replaced_folder(out, "--output") as staging:
        save_file(hf, os.path.join(staging, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(staging, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
            f.write("\n")
    return model, output


IMPORT_EXAMPLE = """\
  # HF -> ours: a params-only checkpoint in ckpt/ (--load ckpt/) and ckpt/model.yaml
  python tools/convert_hf_llama.py import --hf-dir Llama-2-7b-hf/ --output ckpt/ \\
      --seq-length 4096
  hexi-plan plan --cluster examples/clusters/mixed-lab.yaml --model ckpt/model.yaml \\
      --global-batch-size 64 --output plan.json
"""

EXPORT_EXAMPLE = """\
  # ours -> HF: the save ckpt/ points to (its latest), cast to bf16
  python tools/convert_hf_llama.py export --load ckpt/ --output hf/ --dtype bfloat16
  # a given iteration, as stored (fp32 master weights)
  python tools/convert_hf_llama.py export --load ckpt/ --ckpt-step 2000 --output hf-2000/
"""


OVERWRITE_HELP = (
    "replace a non-empty --output folder whole (default: refuse it); its old files are removed "
    "only once the new ones are complete"
)


def head_dim_warning(model):
    """Why transformers may refuse an exported model that the format itself describes."""
    if model.hidden_size % model.num_attention_heads == 0:
        return None
    return (
        f"hidden_size {model.hidden_size} is not a multiple of num_attention_heads "
        f"{model.num_attention_heads}: config.json gives head_dim {model.head_dim}, but "
        f"transformers 5's LlamaConfig refuses such a model whatever head_dim says"
    )


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="convert_hf_llama.py",
        description=__doc__.split("\n")[0],
        epilog=f"examples:\n{IMPORT_EXAMPLE}{EXPORT_EXAMPLE}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser(
        "import",
        help="HF LlamaForCausalLM -> megatron-hexi checkpoint",
        epilog=f"example:\n{IMPORT_EXAMPLE}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    i.add_argument("--hf-dir", required=True)
    i.add_argument("--output", required=True, help="checkpoint directory (use as --load)")
    i.add_argument(
        "--seq-length",
        type=int,
        default=None,
        help="training sequence length for the model YAML (default: max_position_embeddings)",
    )
    i.add_argument("--model-yaml", default=None, help="default: OUTPUT/model.yaml")
    i.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    e = sub.add_parser(
        "export",
        help="megatron-hexi checkpoint -> HF LlamaForCausalLM",
        epilog=f"examples:\n{EXPORT_EXAMPLE}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    e.add_argument("--load", required=True)
    e.add_argument("--ckpt-step", type=int, default=None)
    e.add_argument("--output", required=True)
    e.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="default: as stored (fp32 master weights for a trained checkpoint)",
    )
    e.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    args = p.parse_args(argv)
    try:
        if args.cmd == "import":
            model, final, yml = import_hf(
                args.hf_dir, args.output, args.seq_length, args.model_yaml, args.overwrite
            )
            print(
                f"imported {args.hf_dir} ({sum(_numel(s.shape) for s in canonical_shards(model))}"
                f" parameters) -> {final}; model spec: {yml}"
            )
        else:
            model, out = export_hf(
                args.load,
                args.output,
                args.ckpt_step,
                getattr(torch, args.dtype) if args.dtype else None,
                args.overwrite,
            )
            print(f"exported {args.load} -> {out}/model.safetensors, {out}/config.json")
            warning = head_dim_warning(model)
            if warning:
                print(f"convert_hf_llama.py: warning: {warning}", file=sys.stderr)
    except SpecError as err:
        for line in err.problems:
            print(f"convert_hf_llama.py: error: {line}", file=sys.stderr)
        return 2
    except OSError as err:  # the output's disk full or gone mid-write, say
        where = err.filename or args.output
        print(f"convert_hf_llama.py: error: {where}: {err.strerror}", file=sys.stderr)
        return 2
    return 0


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


if __name__ == "__main__":
    sys.exit(main())
