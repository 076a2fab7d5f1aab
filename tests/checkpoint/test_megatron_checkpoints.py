"""hexi-convert import-megatron / export-megatron against megatron-core's own dist_checkpointing.

A GPT-3-style model (LayerNorm, GELU, linear biases, learned absolute positions with a table
longer than the sequence, GQA, untied output layer) is built with megatron-core in a one-rank
job, randomly initialised and saved as Megatron-LM saves (torch_dist: `model`, `args`,
`iteration`, `checkpoint_version`; and a legacy `mp_rank_00/model_optim_rng.pt`). Both import to
the same tensors; the imported checkpoint's logits under a heterogeneous plan equal the
megatron-core model's; the export loads back into a fresh GPTModel with dist_checkpointing.load,
tensor for tensor.
"""

import argparse
import dataclasses
import os

import torch

from checkpoint.workers import logits
from harness import run_distributed
from planner.models import load_model
from planner.plan import build_plan, save_plan
from runtime.plans import cpu_cluster

SIZES = dict(
    num_layers=4,
    hidden_size=64,
    ffn_hidden_size=192,
    num_attention_heads=8,
    num_query_groups=4,
    padded_vocab_size=120,
    seq_length=32,
    max_position_embeddings=64,
)
PIPELINES = [
    {
        "micro_batch_size": 2,
        "num_microbatches": 4,
        "stages": [
            {
                "ranks": [0, 1],
                "layers": [0, 2],
                "shards": {"query_groups": [3, 1], "ffn": [120, 72], "vocab": [70, 50]},
            },
            {"ranks": [2], "layers": [2, 3]},
            {"ranks": [3], "layers": [3, 4]},
        ],
    }
]


def _megatron_args(iteration):
    """A Megatron-LM run's args, as its checkpoints hold them (the model part)."""
    return argparse.Namespace(
        **SIZES,
        group_query_attention=True,
        kv_channels=8,
        position_embedding_type="learned_absolute",
        normalization="LayerNorm",
        norm_epsilon=1e-5,
        swiglu=False,
        add_bias_linear=True,
        add_qkv_bias=False,
        untie_embeddings_and_output_weights=True,
        init_method_std=0.02,
        bf16=False,
        iteration=iteration,
    )


def _gpt():
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    s = SIZES
    config = TransformerConfig(
        num_layers=s["num_layers"],
        hidden_size=s["hidden_size"],
        ffn_hidden_size=s["ffn_hidden_size"],
        num_attention_heads=s["num_attention_heads"],
        num_query_groups=s["num_query_groups"],
        normalization="LayerNorm",
        gated_linear_unit=False,
        activation_func=F.gelu,
        add_bias_linear=True,
        use_cpu_initialization=True,
        persist_layer_norm=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="LayerNorm"),
        vocab_size=s["padded_vocab_size"],
        max_sequence_length=s["max_position_embeddings"],
        share_embeddings_and_output_weights=False,
        position_embedding_type="learned_absolute",
    )


def _tensors(net):
    return {k: v for k, v in net.state_dict().items() if not k.endswith("_extra_state")}


def _megatron_side(root, tokens):
    """One rank: a megatron-core GPTModel saved both ways, its logits, then the conversions."""
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_hexi.convert.cli import main
    from megatron_hexi.patches import apply_conversion_patches

    apply_conversion_patches()
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)
    torch.manual_seed(0)
    net = _gpt()
    with torch.no_grad():
        for name, p in net.named_parameters():
            p.normal_(1.0 if "layer_norm_weight" in name else 0.0, 0.2)
    saved = os.path.join(root, "megatron")
    os.makedirs(os.path.join(saved, "iter_0000007"))
    state = {
        "model": net.sharded_state_dict(),
        "args": _megatron_args(7),
        "iteration": 7,
        "checkpoint_version": 3.0,
    }
    dist_checkpointing.save(state, os.path.join(saved, "iter_0000007"))
    with open(os.path.join(saved, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("7")
    legacy = os.path.join(root, "legacy")
    os.makedirs(os.path.join(legacy, "iter_0000003", "mp_rank_00"))
    torch.save(
        {"model": net.state_dict(), "args": _megatron_args(3), "iteration": 3},
        os.path.join(legacy, "iter_0000003", "mp_rank_00", "model_optim_rng.pt"),
    )
    with open(os.path.join(legacy, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("3")
    net.eval()
    with torch.no_grad():
        positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
        reference = net(tokens, positions, None).float()
    codes = [
        main(["import-megatron", "--load", saved, "--output", os.path.join(root, "ckpt")]),
        main(["import-megatron", "--load", legacy, "--output", os.path.join(root, "ckpt-legacy")]),
        main(["export-megatron", "--load", os.path.join(root, "ckpt"), "--output", root + "/out"]),
    ]
    back = _gpt()
    exported = os.path.join(root, "out", "release")  # an import is params-only, as release is
    loaded = dist_checkpointing.load({"model": back.sharded_state_dict()}, exported)
    back.load_state_dict(loaded["model"], strict=False)
    before, after = _tensors(net), _tensors(back)
    same = before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    common = dist_checkpointing.load_common_state_dict(exported)
    import multiprocessing

    # the writer's manager process is stopped (a forked rank's exit would not stop it)
    left = [p.name for p in multiprocessing.active_children()]
    return codes, reference, same, common["args"].num_layers, common["iteration"], left


def test_megatron_saves_import_and_export_exactly(tmp_path):
    import pytest

    from megatron_hexi.checkpoint import Checkpoint, CheckpointError, read_full_model

    tokens = torch.randint(0, 120, (8, 32), generator=torch.Generator().manual_seed(3))
    codes, reference, round_trip, layers, iteration, left = run_distributed(
        _megatron_side, 1, str(tmp_path), tokens, timeout=400
    )[0]
    assert codes == [0, 0, 0]
    assert left == [], left
    assert round_trip, "the export loads back into a GPTModel with other tensors"
    assert (layers, iteration) == (4, 0)
    for saved, layout in (("megatron", "torch_dist"), ("legacy", "torch")):
        with pytest.raises(CheckpointError, match=rf"a Megatron-LM checkpoint \({layout}\)") as e:
            Checkpoint(str(tmp_path / saved))
        hint = f"hexi-convert import-megatron --load {tmp_path / saved} --output NEW"
        assert hint in str(e.value)
    _, model, dist_tensors = read_full_model(str(tmp_path / "ckpt"))
    _, legacy_model, legacy_tensors = read_full_model(str(tmp_path / "ckpt-legacy"))
    assert model == dataclasses.replace(legacy_model, name=model.name)
    assert model.position_embedding_type == "learned_absolute" and model.num_query_groups == 4
    assert all(torch.equal(dist_tensors[k], legacy_tensors[k]) for k in dist_tensors)
    spec = load_model(str(tmp_path / "ckpt" / "model.yaml"))
    plan = build_plan(cpu_cluster(4), spec, 8, PIPELINES)
    save_plan(plan, tmp_path / "plan.json")
    ours = run_distributed(
        logits, 4, tmp_path / "plan.json", tmp_path / "ckpt", tokens, timeout=400
    )
    error = ((ours[0] - reference).abs().max() / reference.abs().max()).item()
    print(f"Megatron-LM save under a heterogeneous plan: max relative logit error {error:.2e}")
    assert error < 1e-5
