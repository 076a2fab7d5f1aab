"""tools/convert_hf_llama.py: HF LlamaForCausalLM -> our checkpoint -> logits, and back to HF.

A tiny random Llama (GQA: 4 heads in 2 key/value groups, untied output layer, norms perturbed
away from ones) is saved with transformers, imported, loaded under a heterogeneous plan (three
stages, a TP=2 stage with uneven FFN and vocabulary shards) and run forward; the logits must match
transformers' within 1e-4 (fp32). HF -> ours -> HF must give identical tensors. A second model has
a head size that is not hidden/heads (6 heads of 16 in a hidden size of 72, HF's head_dim, our
kv_channels) and splits its 3 query groups 2:1 in the TP=2 stage.
"""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from checkpoint.hf_models import SIZES, converter, tiny_llama
from checkpoint.workers import logits
from harness import run_distributed
from planner.models import load_model
from planner.plan import build_plan, save_plan
from runtime.plans import cpu_cluster


def pipelines(shards):
    return [
        {
            "micro_batch_size": 2,
            "num_microbatches": 4,
            "stages": [
                {"ranks": [0, 1], "layers": [0, 1], "shards": shards},
                {"ranks": [2], "layers": [1, 3]},
                {"ranks": [3], "layers": [3, 4]},
            ],
        }
    ]


@pytest.mark.parametrize("tie, sizes", [(False, "gqa"), (True, "gqa"), (False, "head_dim")])
def test_round_trip_is_identical(tmp_path, tie, sizes):
    conv = converter()
    tiny_llama(tmp_path / "hf", tie=tie, layers=2, sizes=sizes)
    model, _, yml = conv.import_hf(tmp_path / "hf", tmp_path / "ckpt", seq_length=32)
    assert load_model(str(yml)).untie_embeddings_and_output_weights == (not tie)
    assert model.head_dim == (SIZES[sizes][3] or SIZES[sizes][0] // SIZES[sizes][1])
    conv.export_hf(tmp_path / "ckpt", tmp_path / "back")
    before = load_file(tmp_path / "hf" / "model.safetensors")
    after = load_file(tmp_path / "back" / "model.safetensors")
    assert before.keys() == after.keys()
    for name in before:
        assert before[name].dtype == after[name].dtype and torch.equal(before[name], after[name]), (
            name
        )
    cfg_a = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg_b = json.loads((tmp_path / "back" / "config.json").read_text())
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "rms_norm_eps",
        "tie_word_embeddings",
        "head_dim",
        "rope_parameters",
        "max_position_embeddings",
        "bos_token_id",
    ):
        assert cfg_a[key] == cfg_b[key], key
    # transformers loads the export, with the head size it was saved with.
    back = LlamaForCausalLM.from_pretrained(tmp_path / "back")
    assert back.model.layers[0].self_attn.head_dim == model.head_dim
    # So does a checkpoint that was never imported (no HF config to start from).
    assert LlamaConfig(**conv.hf_config(model)).head_dim == model.head_dim


@pytest.mark.parametrize("sizes", list(SIZES))
def test_logits_match_transformers_under_a_heterogeneous_plan(tmp_path, sizes):
    conv = converter()
    hf = tiny_llama(tmp_path / "hf", sizes=sizes)
    hidden, heads, groups, _, shards = SIZES[sizes]
    _, _, yml = conv.import_hf(tmp_path / "hf", tmp_path / "ckpt", seq_length=32)
    model = load_model(str(yml))
    plan = build_plan(cpu_cluster(4), model, 8, pipelines(shards))
    save_plan(plan, tmp_path / "plan.json")
    tokens = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(3))
    ours = run_distributed(
        logits, 4, tmp_path / "plan.json", tmp_path / "ckpt", tokens, timeout=300
    )[0]
    with torch.no_grad():
        reference = hf(tokens).logits.float()
    diff = (ours - reference).abs().max().item()
    # The comparison is sensitive to the rotary layout: with q and k rows permuted to the
    # interleaved (Meta) order, transformers' logits move far more than the tolerance.
    with torch.no_grad():
        half = model.head_dim // 2
        for layer in hf.model.layers:
            for proj, n in ((layer.self_attn.q_proj, heads), (layer.self_attn.k_proj, groups)):
                w = proj.weight
                proj.weight.copy_(w.view(n, half, 2, hidden).transpose(1, 2).reshape(w.shape))
        interleaved = hf(tokens).logits.float()
    wrong = (ours - interleaved).abs().max().item()
    print(
        f"max |logits - transformers' logits| = {diff:.2e} (logits up to "
        f"{reference.abs().max().item():.2f}; against an interleaved-rotary model: {wrong:.2e})"
    )
    assert diff < 1e-4
    assert wrong > 1e-2


def test_unsupported_hf_models_are_clear_errors(tmp_path):
    conv = converter()
    from planner.errors import SpecError

    sizes = {
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "intermediate_size": 8,
        "num_attention_heads": 4,
        "vocab_size": 8,
    }
    with pytest.raises(SpecError, match="rope type 'yarn'"):
        conv.model_fields({**sizes, "rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5}})
    llama3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}
    with pytest.raises(SpecError, match="llama3 rope high_freq_factor is 2.0; megatron-core"):
        conv.model_fields({**sizes, "rope_parameters": {**llama3, "high_freq_factor": 2.0}})
    with pytest.raises(SpecError, match="model_type 'gpt2' is not supported"):
        conv.model_fields({**sizes, "model_type": "gpt2"})
    with pytest.raises(SpecError, match="sliding_window 16 is shorter than the sequence"):
        conv.model_fields({**sizes, "model_type": "mistral", "sliding_window": 16}, 32)
    # Qwen2's window applies only with use_sliding_window; Mistral's is fine when it covers all
    assert conv.model_fields({**sizes, "model_type": "qwen2", "sliding_window": 16}, 32)
    assert conv.model_fields({**sizes, "model_type": "mistral", "sliding_window": 32}, 32)
    with pytest.raises(SpecError, match="no model.safetensors"):
        conv.read_hf_tensors(tmp_path)


def test_head_dim_that_is_not_hidden_over_heads_is_exported(tmp_path):
    """hidden 80 in 6 heads of 16: config.json must say head_dim 16 (readers otherwise take
    80 // 6 = 13), import must read it back, and the exporter warns that transformers 5 still
    refuses the model (its LlamaConfig wants hidden_size to be a multiple of the heads)."""
    conv = converter()
    from planner.models import model_from_dict

    model = model_from_dict(
        {
            "num_layers": 2,
            "hidden_size": 80,
            "ffn_hidden_size": 96,
            "num_attention_heads": 6,
            "num_query_groups": 2,
            "vocab_size": 128,
            "seq_length": 32,
            "kv_channels": 16,
        }
    )
    cfg = conv.hf_config(model)
    assert cfg["head_dim"] == 16
    assert conv.model_fields(cfg)["kv_channels"] == 16
    assert "head_dim 16" in conv.head_dim_warning(model)
    with pytest.raises(Exception, match="not a multiple of the number of attention heads"):
        LlamaConfig(**cfg)  # if transformers accepts it one day, drop the warning
    assert conv.head_dim_warning(model_from_dict({**model.to_dict(), "hidden_size": 96})) is None


def test_help_shows_runnable_examples(capsys):
    with pytest.raises(SystemExit):
        converter().main(["--help"])
    out = capsys.readouterr().out
    assert "convert_hf_llama.py import --hf-dir" in out
    assert "convert_hf_llama.py export --load" in out
