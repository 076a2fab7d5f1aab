"""Import a Hugging Face model folder as a params-only checkpoint, and export any checkpoint back.

The import keeps the HF config in the checkpoint's metadata and copies the tokenizer and
generation files into `hf_files/` beside the weights; the export starts from that config (or from
the family's defaults) and writes those files back, so that `transformers` loads the export with
its tokenizer. A checkpoint saved by training on top of an import has no `hf_files/`:
`--tokenizer-dir` names the folder to take them from.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch
import yaml

from megatron_hexi.convert.families import check_exportable, hf_config, model_fields
from megatron_hexi.convert.tensors import canonical_to_hf, hf_to_canonical
from megatron_hexi.hf_files import folder_file, read_config, read_tensors
from megatron_hexi.output_folder import check_output, replaced_folder, write_file_atomically
from planner.errors import SpecError
from planner.models import ModelSpec, model_from_dict

# Files of an HF model folder that are not weights and that an export should carry.
HF_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
)
HF_FILES_DIR = "hf_files"
MAX_HF_FILE_BYTES = 256 * 2**20  # the largest tokenizer.json files are ~20 MB


def read_hf_tensors(hf_dir: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of model.safetensors or of the shards listed in model.safetensors.index.json
    (megatron_hexi.hf_files: regular files inside the folder, each tensor once, floats only)."""
    return read_tensors(os.path.realpath(hf_dir))


def _kept_files(folder: str) -> list[tuple[str, str]]:
    """(name, real path) of the HF_FILES present in `folder`, each a regular file inside it."""
    out = []
    real_folder = os.path.realpath(folder)
    for name in HF_FILES:
        if not os.path.lexists(os.path.join(folder, name)):
            continue
        path = folder_file(real_folder, name, os.path.join(folder, name))
        if os.path.getsize(path) > MAX_HF_FILE_BYTES:
            raise SpecError(f"{os.path.join(folder, name)}: larger than {MAX_HF_FILE_BYTES} bytes")
        out.append((name, path))
    return out


def import_hf(
    hf_dir: str | os.PathLike[str],
    output: str | os.PathLike[str],
    seq_length: int | None = None,
    model_yaml: str | None = None,
    overwrite: bool = False,
) -> tuple[ModelSpec, str, str]:
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
    kept = _kept_files(hf_dir)
    text = f"# planner model spec of {hf_dir} (hexi-convert import)\n" + yaml.safe_dump(
        {k: v for k, v in fields.items() if k != "name"}, sort_keys=False
    )
    with replaced_folder(out, "--output") as staging:
        final = save_params_only(
            staging,
            model,
            canon,
            extra={"hf_config": cfg, "imported_from": os.path.abspath(hf_dir)},
        )
        if kept:
            os.makedirs(os.path.join(staging, HF_FILES_DIR))
            for name, path in kept:
                shutil.copyfile(path, os.path.join(staging, HF_FILES_DIR, name))
        if yml_inside:
            inner = os.path.join(staging, os.path.relpath(yml, out))
            os.makedirs(os.path.dirname(inner), exist_ok=True)
            with open(inner, "w") as f:
                f.write(text)
    if not yml_inside:
        write_file_atomically(yml, text, "--model-yaml", overwrite)
    return model, os.path.join(out, os.path.relpath(final, staging)), yml


def _generation_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """transformers' minimal generation_config.json for a model config without one."""
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {k: cfg[k] for k in keys if cfg.get(k) is not None}


def export_hf(
    load_dir: str | os.PathLike[str],
    output: str | os.PathLike[str],
    step: int | None = None,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
    tokenizer_dir: str | os.PathLike[str] | None = None,
) -> tuple[ModelSpec, str, list[str]]:
    """Any megatron-hexi checkpoint -> HF model.safetensors, config.json, generation_config.json
    and the tokenizer files in `output` (a non-empty `output` is replaced whole with
    `overwrite`, else refused). Returns (ModelSpec, output, names of the files carried)."""
    from safetensors.torch import save_file

    from megatron_hexi.checkpoint import read_full_model

    inputs = [("--load", os.fspath(load_dir))]
    if tokenizer_dir is not None:
        inputs.append(("--tokenizer-dir", os.fspath(tokenizer_dir)))
    out = check_output(os.fspath(output), "--output", overwrite, inputs)
    load_dir = os.fspath(load_dir)
    source = os.fspath(tokenizer_dir) if tokenizer_dir else os.path.join(load_dir, HF_FILES_DIR)
    if tokenizer_dir is not None and not os.path.isdir(source):
        raise SpecError(f"--tokenizer-dir {source}: no such folder")
    kept = _kept_files(source) if os.path.isdir(source) else []
    ckpt, model, canon = read_full_model(load_dir, step)
    check_exportable(model)
    hf = canonical_to_hf(canon, model)
    if dtype is not None:
        hf = {k: v.to(dtype) for k, v in hf.items()}
    hf = {k: v.contiguous() for k, v in hf.items()}
    cfg = hf_config(model, ckpt.meta.get("hf_config"))
    cfg["dtype"] = str(next(iter(hf.values())).dtype).replace("torch.", "")
    with replaced_folder(out, "--output") as staging:
        save_file(hf, os.path.join(staging, "model.safetensors"), metadata={"format": "pt"})
        _write_json(os.path.join(staging, "config.json"), cfg)
        for name, path in kept:
            shutil.copyfile(path, os.path.join(staging, name))
        if "generation_config.json" not in {n for n, _ in kept}:
            _write_json(os.path.join(staging, "generation_config.json"), _generation_config(cfg))
    return model, os.fspath(output), [n for n, _ in kept]


def _write_json(path: str, data: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")


def head_dim_warning(model: ModelSpec) -> str | None:
    """Why transformers may refuse an exported model that the format itself describes."""
    if model.hidden_size % model.num_attention_heads == 0:
        return None
    return (
        f"hidden_size {model.hidden_size} is not a multiple of num_attention_heads "
        f"{model.num_attention_heads}: config.json gives head_dim {model.head_dim}, but "
        f"transformers 5's LlamaConfig refuses such a model whatever head_dim says"
    )
