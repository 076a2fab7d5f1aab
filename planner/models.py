"""Model specs: a Llama-style decoder described with Megatron's field names.

The defaults are Llama's (RMSNorm, rotary embeddings, SwiGLU, no linear biases, untied output
layer), so a spec needs only the sizes.
"""

import dataclasses
import os
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

import yaml

from planner.errors import ModelSpecError, SpecError
from planner.inputs import document_problems, int_problem, is_number, read_yaml
from planner.limits import (
    MAX_HIDDEN,
    MAX_INIT_METHOD_STD,
    MAX_NORM_EPSILON,
    MAX_ROPE_SCALING_FACTOR,
    MAX_ROTARY_BASE,
    MAX_SEQ_LENGTH,
    MODEL_INT_BOUNDS,
)

_INT_FIELDS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "vocab_size",
    "seq_length",
)


@dataclass(frozen=True)
class ModelSpec:
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    vocab_size: int
    seq_length: int
    swiglu: bool = True
    untie_embeddings_and_output_weights: bool = True
    normalization: str = "RMSNorm"
    norm_epsilon: float = 1e-5
    position_embedding_type: str = "rope"
    rotary_base: int = 10000
    add_bias_linear: bool = False
    add_qkv_bias: bool = False  # biases on q, k and v only (Qwen2); add_bias_linear implies them
    rope_scaling: bool = False  # Llama 3.x's frequency scaling (megatron-core's rope_scaling)
    rope_scaling_factor: float = 8.0
    max_position_embeddings: int = 0  # rows of the learned position table; 0: seq_length
    kv_channels: int = 0  # 0: hidden_size // num_attention_heads
    init_method_std: float = 0.02
    name: str = ""

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def qkv_bias(self) -> bool:
        """Whether the fused q/k/v projection has a bias (megatron-core's rule)."""
        return self.add_bias_linear or self.add_qkv_bias

    @property
    def position_rows(self) -> int:
        """Rows of the learned absolute position table (0 under rotary embeddings)."""
        if self.position_embedding_type != "learned_absolute":
            return 0
        return self.max_position_embeddings or self.seq_length

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    @property
    def ffn_width(self) -> int:
        """Rows of the first MLP weight: 2 x ffn for SwiGLU (gate and up), else ffn."""
        return 2 * self.ffn_hidden_size if self.swiglu else self.ffn_hidden_size

    def to_dict(self) -> dict[str, Any]:
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name in _INT_FIELDS or getattr(self, f.name) != f.default
        }


def model_from_dict(data: object, where: str = "model") -> ModelSpec:
    """Validate and build a ModelSpec; every problem is one line naming the field.

    Sizes are bounded (planner/limits.py) so that no spec makes the cost model overflow or the
    search loop for long; numbers must be finite and of their type (no bools, no 4.0 layers).
    """
    problems = document_problems(data, where)
    if problems:
        raise ModelSpecError(problems)
    if not isinstance(data, dict):
        raise ModelSpecError(f"{where}: must be a mapping of Megatron model fields")
    known = {f.name: f for f in dataclasses.fields(ModelSpec)}
    problems = [f"{where}.{k}: unknown field" for k in sorted(set(data) - set(known))]
    problems += [f"{where}.{k}: missing required field" for k in _INT_FIELDS if k not in data]
    for k in _INT_FIELDS:
        if k in data:
            bad = int_problem(data[k], f"{where}.{k}", 1, MODEL_INT_BOUNDS[k])
            if bad:
                problems.append(bad)
    for k in (
        "swiglu",
        "untie_embeddings_and_output_weights",
        "add_bias_linear",
        "add_qkv_bias",
        "rope_scaling",
    ):
        if k in data and not isinstance(data[k], bool):
            problems.append(f"{where}.{k}: must be true or false, got {data[k]!r}")
    for k, lo, hi in (
        ("kv_channels", 0, MAX_HIDDEN),
        ("rotary_base", 1, MAX_ROTARY_BASE),
        ("max_position_embeddings", 0, MAX_SEQ_LENGTH),
    ):
        if k in data:
            bad = int_problem(data[k], f"{where}.{k}", lo, hi)
            if bad:
                problems.append(bad)
    for k, top in (("norm_epsilon", MAX_NORM_EPSILON), ("init_method_std", MAX_INIT_METHOD_STD)):
        v = data.get(k, top)
        if not is_number(v) or not 0 < v <= top:
            problems.append(f"{where}.{k}: must be a finite number in (0, {top:g}], got {v!r}")
    if not isinstance(data.get("name", ""), str):
        problems.append(f"{where}.name: must be a string, got {data['name']!r}")
    if data.get("normalization", "RMSNorm") not in ("RMSNorm", "LayerNorm"):
        problems.append(f"{where}.normalization: must be RMSNorm or LayerNorm")
    positions = data.get("position_embedding_type", "rope")
    if positions not in ("rope", "learned_absolute"):
        problems.append(f"{where}.position_embedding_type: must be rope or learned_absolute")
    factor = data.get("rope_scaling_factor", 8.0)
    if not is_number(factor) or not 1 <= factor <= MAX_ROPE_SCALING_FACTOR:
        problems.append(
            f"{where}.rope_scaling_factor: must be a number in [1, {MAX_ROPE_SCALING_FACTOR:g}], "
            f"got {factor!r}"
        )
    if data.get("rope_scaling") is True and positions != "rope":
        problems.append(f"{where}.rope_scaling: needs position_embedding_type rope")
    if problems:
        raise ModelSpecError(problems)
    spec = ModelSpec(**{k: v for k, v in data.items()})
    if spec.num_attention_heads % spec.num_query_groups:
        problems.append(
            f"{where}.num_query_groups: {spec.num_query_groups} does not divide "
            f"num_attention_heads {spec.num_attention_heads}"
        )
    if not spec.kv_channels and spec.hidden_size % spec.num_attention_heads:
        problems.append(
            f"{where}.hidden_size: {spec.hidden_size} is not a multiple of "
            f"num_attention_heads {spec.num_attention_heads} (or give kv_channels)"
        )
    if 0 < spec.max_position_embeddings < spec.seq_length:
        problems.append(
            f"{where}.max_position_embeddings: {spec.max_position_embeddings} is below "
            f"seq_length {spec.seq_length}"
        )
    if spec.position_embedding_type == "rope" and spec.head_dim % 2:
        problems.append(
            f"{where}.kv_channels: rotary embeddings need an even head size, got {spec.head_dim}"
        )
    if problems:
        raise ModelSpecError(problems)
    return spec


@lru_cache(maxsize=1)
def model_catalog() -> dict[str, ModelSpec]:
    raw = yaml.safe_load(resources.files("planner").joinpath("data/models.yaml").read_text())
    return {name: model_from_dict({**fields, "name": name}, name) for name, fields in raw.items()}


def load_model(name_or_path: str | os.PathLike[str]) -> ModelSpec:
    """A catalog name (llama2-7b, tiny, ...) or a YAML file with Megatron field names."""
    catalog = model_catalog()
    if name_or_path in catalog:
        return catalog[name_or_path]
    if not str(name_or_path).endswith((".yaml", ".yml", ".json")):
        raise SpecError(
            f"--model: {name_or_path!r} is neither a catalog model "
            f"({', '.join(catalog)}) nor a .yaml file"
        )
    try:
        data = read_yaml(name_or_path, "model file")
    except SpecError as e:
        raise ModelSpecError(e.problems)
    try:
        return model_from_dict(data, "model")
    except ModelSpecError as e:
        raise ModelSpecError([f"{name_or_path}: {p}" for p in e.problems])
