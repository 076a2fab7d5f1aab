"""Hugging Face model families this converter maps, and their config.json <-> model-spec fields.

Llama (1, 2 and 3.x), Mistral and Qwen2/2.5 share one tensor layout: RMSNorm, rotary embeddings
in halves (HF's rotate_half, megatron-core's rotary_interleaved=False), SwiGLU, GQA, optional tied
embeddings and an explicit head_dim. They differ in what the config may hold:
- Llama 3.x scales RoPE frequencies (`rope_type: llama3`). megatron-core applies Meta's scaling
  with a free factor and fixed low/high frequency factors 1 and 4 and an original context of
  8192, which are the values of every Llama 3.1, 3.2 and 3.3 release; others are refused.
- Mistral may attend within a sliding window. Full attention equals it only where the window
  covers the whole sequence, so a narrower window is refused.
- Qwen2 has biases on q, k and v (megatron-core's add_qkv_bias), and sliding-window attention
  only when `use_sliding_window` is set.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from planner.errors import SpecError
from planner.inputs import is_int, is_number, short
from planner.models import ModelSpec

# megatron-core's fixed llama3 RoPE scaling parameters (RotaryEmbedding._apply_scaling)
LLAMA3_FIXED = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


class Family(NamedTuple):
    model_type: str
    architecture: str
    qkv_bias: bool  # q/k/v projections carry biases


FAMILIES = {
    "llama": Family("llama", "LlamaForCausalLM", False),
    "mistral": Family("mistral", "MistralForCausalLM", False),
    "qwen2": Family("qwen2", "Qwen2ForCausalLM", True),
}
_MISSING = object()


def family_of(cfg: dict[str, Any]) -> Family:
    kind = cfg.get("model_type", "llama")
    if kind not in FAMILIES:
        raise SpecError(
            f"config.json: model_type {kind!r} is not supported; expected one of "
            f"{', '.join(repr(k) for k in FAMILIES)}"
        )
    return FAMILIES[kind]


def _int_field(cfg: dict[str, Any], key: str, problems: list[str], default: Any = _MISSING) -> Any:
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


def _positive_number(
    cfg: dict[str, Any], key: str, default: float, problems: list[str]
) -> float | None:
    """cfg[key] as a finite number > 0 (`default` when absent), else a problem line."""
    value = cfg.get(key, default)
    if not is_number(value) or value <= 0:
        problems.append(f"config.json: {key} is {short(value)}, expected a finite number > 0")
        return None
    return float(value)


def _rope(cfg: dict[str, Any]) -> dict[str, Any]:
    """The rotary fields of the spec: rotary_base, and Llama 3.x's scaling where given."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    for key, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if not isinstance(value, dict):
            raise SpecError(f"config.json: {key} is {short(value)}, expected an object")
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind not in ("default", "llama3"):
        raise SpecError(
            f"config.json: rope type {short(kind)} (RoPE scaling) is not supported; only "
            f"plain rotary embeddings and Llama 3's 'llama3' scaling are"
        )
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    if not is_number(theta) or theta <= 0 or float(theta) != int(theta):
        raise SpecError(f"config.json: rope_theta is {short(theta)}, expected an integer > 0")
    out: dict[str, Any] = {"rotary_base": int(theta)}
    if kind == "llama3":
        given = {**scaling, **params}
        factor = given.get("factor")
        if not is_number(factor) or factor < 1:
            raise SpecError(
                f"config.json: llama3 rope factor is {short(factor)}, expected a number >= 1"
            )
        for key, value in LLAMA3_FIXED.items():
            if given.get(key, value) != value:
                raise SpecError(
                    f"config.json: llama3 rope {key} is {short(given.get(key))}; megatron-core "
                    f"scales with {value:g} (every Llama 3.1-3.3 release does)"
                )
        out.update(rope_scaling=True, rope_scaling_factor=float(factor))
    return out


def _sliding_window(cfg: dict[str, Any], family: Family, seq_length: int) -> str | None:
    """Why the model's sliding window changes what full attention computes, or None."""
    if family.model_type == "llama" or (
        family.model_type == "qwen2" and not cfg.get("use_sliding_window", False)
    ):
        return None
    window = cfg.get("sliding_window")
    if window is None:
        return None
    if not is_int(window) or window < 1:
        return f"config.json: sliding_window is {short(window)}, expected an integer >= 1 or null"
    if window < seq_length:
        return (
            f"config.json: sliding_window {window} is shorter than the sequence ({seq_length}): "
            f"sliding-window attention is not supported; convert with --seq-length {window} "
            f"or less"
        )
    return None


def model_fields(cfg: dict[str, Any], seq_length: int | None = None) -> dict[str, Any]:
    """Planner model-spec fields (Megatron names) of an HF config dict of a supported family."""
    family = family_of(cfg)
    problems: list[str] = []
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"config.json: hidden_act {cfg['hidden_act']!r}, only silu (SwiGLU)")
    for flag in ("attention_bias", "mlp_bias"):
        if cfg.get(flag):
            problems.append(
                f"config.json: {flag} true is not supported ({family.architecture} here has "
                f"{'q/k/v biases only' if family.qkv_bias else 'no biases'})"
            )
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
    if positions is not None:
        window = _sliding_window(cfg, family, positions)
        if window:
            problems.append(window)
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
        "add_bias_linear": False,
        "init_method_std": float(std),
        **_rope(cfg),
    }
    if family.qkv_bias:
        fields["add_qkv_bias"] = True
    if head_dim and head_dim != hidden // heads:
        fields["kv_channels"] = head_dim
    return fields


def check_exportable(model: ModelSpec) -> None:
    if (
        not model.swiglu
        or model.normalization != "RMSNorm"
        or model.add_bias_linear
        or model.position_embedding_type != "rope"
    ):
        raise SpecError(
            "export: only Llama-style models (SwiGLU, RMSNorm, rotary embeddings, no linear "
            "biases but q/k/v ones) map to a Hugging Face family here"
        )


def export_family(model: ModelSpec, base: dict[str, Any] | None) -> Family:
    """The family an export writes: the imported one where it fits the model, else Qwen2 for
    q/k/v biases and Llama otherwise."""
    if base and base.get("model_type") in FAMILIES:
        family = FAMILIES[base["model_type"]]
        if family.qkv_bias == model.add_qkv_bias:
            return family
    return FAMILIES["qwen2"] if model.add_qkv_bias else FAMILIES["llama"]


def hf_config(model: ModelSpec, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """An HF config dict of the export's family for spec `model` (keeping `base`'s other keys
    where `base` is of that family)."""
    family = export_family(model, base)
    if not base or base.get("model_type") != family.model_type:
        base = {
            "hidden_act": "silu",
            "attention_dropout": 0.0,
            "use_cache": True,
            "bos_token_id": 1,
            "eos_token_id": 2,
            **(
                {"attention_bias": False, "mlp_bias": False} if family.model_type == "llama" else {}
            ),
            **({"pretraining_tp": 1} if family.model_type == "llama" else {}),
            **({"use_sliding_window": False} if family.model_type == "qwen2" else {}),
            **({"sliding_window": None} if family.model_type != "llama" else {}),
        }
    cfg = dict(base)
    cfg.pop("rope_scaling", None)
    rope: dict[str, Any] = {"rope_theta": float(model.rotary_base), "rope_type": "default"}
    if model.rope_scaling:
        rope.update(rope_type="llama3", factor=float(model.rope_scaling_factor), **LLAMA3_FIXED)
    cfg.update(
        {
            "architectures": [family.architecture],
            "model_type": family.model_type,
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
            "rope_parameters": rope,
        }
    )
    cfg.pop("rope_theta", None)
    return cfg
