"""hexi-convert with the other families: Llama 3.x (llama3 RoPE scaling), Mistral and Qwen2
(q/k/v biases, tied embeddings). Tiny random models made with transformers are imported, run
forward under a heterogeneous plan (a TP-2 stage with uneven query-group, FFN and vocabulary
shards, then two one-rank stages) and compared with transformers' logits; the export of each
is bit-identical to what was imported, of the same family, and carries its tokenizer files.
"""

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from checkpoint.workers import logits
from harness import run_distributed
from megatron_hexi.convert.hf import export_hf, import_hf
from planner.models import load_model
from planner.plan import build_plan, save_plan
from runtime.plans import cpu_cluster

TOLERANCE = 1e-5  # relative to the largest logit, fp32
SIZES = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    rms_norm_eps=1e-5,
    max_position_embeddings=64,
    initializer_range=0.25,  # large enough for sharp attention patterns
)
CONFIGS = {
    "llama3": lambda: LlamaConfig(
        **SIZES,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    "mistral": lambda: MistralConfig(**SIZES, sliding_window=None, rope_theta=1000000.0),
    "qwen2": lambda: Qwen2Config(**SIZES, tie_word_embeddings=True, rope_theta=1000000.0),
}
ARCHITECTURES = {
    "llama3": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
PIPELINES = [
    {
        "micro_batch_size": 2,
        "num_microbatches": 4,
        "stages": [
            {
                "ranks": [0, 1],
                "layers": [0, 1],
                "shards": {"query_groups": [3, 1], "ffn": [100, 60], "vocab": [90, 38]},
            },
            {"ranks": [2], "layers": [1, 3]},
            {"ranks": [3], "layers": [3, 4]},
        ],
    }
]


def tiny(family, directory):
    config = CONFIGS[family]()
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):  # ones and zeros would hide mix-ups
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(directory)
    (directory / "tokenizer_config.json").write_text('{"model_max_length": 64}\n')
    return model


def logits_each(cases):
    """`logits` of each (plan, checkpoint, tokens), one after another in the same processes."""
    return [logits(*case) for case in cases]


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """{family: (HF model, checkpoint, plan, tokens)}: each family imported, with its plan."""
    out = {}
    for family in CONFIGS:
        root = tmp_path_factory.mktemp(family)
        hf = tiny(family, root / "hf")
        _, _, yml = import_hf(root / "hf", root / "ckpt", seq_length=32)
        plan = build_plan(cpu_cluster(4), load_model(str(yml)), 8, PIPELINES)
        save_plan(plan, root / "plan.json")
        tokens = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(3))
        out[family] = (hf, root / "ckpt", root / "plan.json", tokens)
    return out


def test_each_family_matches_transformers_under_a_heterogeneous_plan(imported):
    cases = [(plan, ckpt, tokens) for _, ckpt, plan, tokens in imported.values()]
    ours = run_distributed(logits_each, 4, cases, timeout=400)[0]
    for (family, (hf, _, _, tokens)), got in zip(imported.items(), ours):
        with torch.no_grad():
            reference = hf(tokens).logits.float()
        error = ((got - reference).abs().max() / reference.abs().max()).item()
        print(f"{family}: max relative logit error {error:.2e}")
        assert error < TOLERANCE, family


def test_llama3_scaling_is_what_changes_the_logits(imported):
    """The RoPE scaling reaches the model: the same weights without it give other logits."""
    hf, _, _, tokens = imported["llama3"]
    plain = AutoModelForCausalLM.from_config(
        LlamaConfig(**SIZES, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    ).eval()
    plain.load_state_dict(hf.state_dict())
    with torch.no_grad():
        moved = (plain(tokens).logits - hf(tokens).logits).abs().max().item()
    assert moved > 100 * TOLERANCE * hf(tokens).logits.abs().max().item()


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_export_is_identical_and_of_the_same_family(imported, family, tmp_path):
    _, ckpt, _, _ = imported[family]
    source = ckpt.parent / "hf"
    _, _, carried = export_hf(ckpt, tmp_path / "back")
    assert carried == ["tokenizer_config.json", "generation_config.json"]
    before, after = (load_file(d / "model.safetensors") for d in (source, tmp_path / "back"))
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURES[family]]
    original = json.loads((source / "config.json").read_text())
    assert config["rope_parameters"] == original["rope_parameters"]
    assert (tmp_path / "back" / "tokenizer_config.json").read_text() == (
        source / "tokenizer_config.json"
    ).read_text()
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "back")
    assert type(back).__name__ == ARCHITECTURES[family]


def test_verify_passes_a_good_conversion_and_catches_an_altered_one(
    imported, tmp_path, capsys, monkeypatch
):
    """`hexi-convert verify` under the plan: the import passes; the same HF folder with layer
    0's k and v projections swapped (a converter's typical slip) fails with exit 1.

    Both calls load the same checkpoint under the same plan on the same tokens, so the plan's
    ranks are launched once: the second call's runtime logits are the first's, handed back
    only for the very same arguments (the plan file's content, checkpoint, device, tokens).
    verify forks its ranks from this process's forkserver: the session's (torch imported once),
    started here if no test has started it yet."""
    import shutil

    from safetensors.torch import save_file

    import forkserver
    from megatron_hexi.convert import verify
    from megatron_hexi.convert.cli import main

    forkserver.context()

    launched = []
    launch = verify.runtime_logits

    def launch_once(plan_path, load, device, tokens, world, timeout_s):
        key = (open(plan_path).read(), load, device, world)
        if not launched:
            launched.append(
                (key, tokens, launch(plan_path, load, device, tokens, world, timeout_s))
            )
        ((first, first_tokens, logits),) = launched
        assert key == first and torch.equal(tokens, first_tokens)
        return logits.clone()

    monkeypatch.setattr(verify, "runtime_logits", launch_once)
    _, ckpt, plan, _ = imported["qwen2"]
    source = ckpt.parent / "hf"
    argv = ["verify", "--load", str(ckpt), "--hetero-plan-path", str(plan), "--seq-length", "16"]
    environment = dict(os.environ)
    assert main([*argv, "--hf-dir", str(source)]) == 0
    assert dict(os.environ) == environment  # the ranks' identities stay in their processes
    good = capsys.readouterr().out
    error = float(good.split("max relative logit error: ")[1].split()[0])
    assert error < 1e-5
    altered = tmp_path / "altered"
    shutil.copytree(source, altered)
    tensors = load_file(altered / "model.safetensors")
    k, v = (f"model.layers.0.self_attn.{p}_proj.weight" for p in "kv")
    tensors[k], tensors[v] = tensors[v].clone(), tensors[k].clone()
    save_file(tensors, altered / "model.safetensors", metadata={"format": "pt"})
    assert main([*argv, "--hf-dir", str(altered)]) == 1
    captured = capsys.readouterr()
    wrong = float(captured.out.split("max relative logit error: ")[1].split()[0])
    print(f"verify: good conversion {error:.2e}, altered one {wrong:.2e}")
    assert wrong > 1e-2
    assert captured.err.startswith("hexi-convert: error: above 1e-05"), captured.err
    assert len(launched) == 1
