"""Attention backends: torch's fused attention (`SDPAttention`, the plan's attention_backend auto,
flash or fused) computes what megatron-core's unfused `DotProductAttention` computes, keeps no
s x s tensor, and trains every equivalence plan as the one-rank plan does."""

import pytest

from harness import run_distributed
from runtime.equivalence import TOLERANCE, compare, reference
from runtime.plans import PLANS, REFERENCE, write_plan
from runtime.workers import train_each


def _compare_modules():
    """One rank: the same query, key and value (GQA: 8 heads in 2 query groups, causal) through
    both modules, in fp32 and bf16, with and without dropout; the saved-for-backward bytes."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_hexi.attention import SDPAttention
    from megatron_hexi.model import seed_rng
    from megatron_hexi.patches import apply_cpu_patches

    apply_cpu_patches()
    if parallel_state._GLOBAL_MEMORY_BUFFER is None:
        parallel_state._set_global_memory_buffer()
    seed_rng(1234, 0)
    pg = ProcessGroupCollection(tp=dist.group.WORLD)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for dropout in (0.0, 0.1):
            config = TransformerConfig(
                num_layers=1,
                hidden_size=128,
                num_attention_heads=8,
                num_query_groups=2,
                kv_channels=16,
                attention_dropout=dropout,
                params_dtype=dtype,
                bf16=dtype == torch.bfloat16,
                masked_softmax_fusion=False,
                use_cpu_initialization=True,
            )
            modules = {
                cls.__name__: cls(config, 1, AttnMaskType.causal, "self", pg_collection=pg)
                for cls in (DotProductAttention, SDPAttention)
            }
            g = torch.Generator().manual_seed(0)
            s, b = 256, 2
            q = torch.randn(s, b, 8, 16, generator=g).to(dtype)
            k = torch.randn(s, b, 2, 16, generator=g).to(dtype)
            v = torch.randn(s, b, 2, 16, generator=g).to(dtype)
            results = {}
            for name, module in modules.items():
                inputs = [t.clone().requires_grad_() for t in (q, k, v)]
                saved = [0]

                def pack(t, saved=saved):
                    saved[0] += t.numel() * t.element_size()
                    return t

                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    context = module(*inputs, None)
                context.float().square().sum().backward()
                results[name] = {
                    "context": context.detach().float(),
                    "grads": [t.grad.float() for t in inputs],
                    "saved_bytes": saved[0],
                }
                if dropout:  # the tracker decides the draw: a second call draws anew
                    again = module(*[t.detach() for t in inputs], None)
                    results[name]["redraw_differs"] = not torch.equal(again, context.detach())
            out[(str(dtype), dropout)] = results
    seed_rng(1234, 0)
    first = modules["SDPAttention"](q, k, v, None)
    seed_rng(1234, 0)
    second = modules["SDPAttention"](q, k, v, None)
    out["same_seed_same_draw"] = torch.equal(first, second)
    return out


def test_fused_attention_matches_unfused_and_keeps_no_scores():
    from runtime.workers import max_relative_difference

    out = run_distributed(_compare_modules, 1, timeout=120)[0]
    scores_fp32 = 2 * 8 * 256 * 256 * 4  # [b, heads, s, s] in fp32
    per_head_rows = 2 * 8 * 256 * 16 * 4  # [b, heads, s, d] in fp32: 16 times smaller
    for (dtype, dropout), results in ((k, v) for k, v in out.items() if isinstance(k, tuple)):
        ref, fused = results["DotProductAttention"], results["SDPAttention"]
        if dropout == 0.0:
            tol = 1e-5 if "float32" in dtype else 2e-2
            err = max_relative_difference(fused["context"], ref["context"])
            grad = max(max_relative_difference(a, b) for a, b in zip(fused["grads"], ref["grads"]))
            print(f"{dtype}: context {err:.1e}, grads of q, k, v {grad:.1e}")
            assert err < tol and grad < tol, (dtype, err, grad)
            # the unfused module keeps its s x s probabilities; the fused kernel keeps only
            # [b, heads, s, d]-sized tensors (query, key, value, output; a row statistic)
            itemsize = 4 if "float32" in dtype else 2
            print(f"{dtype}: saved for backward {ref['saved_bytes']} / {fused['saved_bytes']} B")
            assert ref["saved_bytes"] >= scores_fp32 * itemsize // 4, ref["saved_bytes"]
            assert fused["saved_bytes"] <= 5 * per_head_rows * itemsize // 4, fused["saved_bytes"]
        else:
            assert fused["redraw_differs"] and ref["redraw_differs"]
    assert out["same_seed_same_draw"]


@pytest.mark.parametrize("name", sorted(PLANS))
def test_fused_attention_plans_match_one_rank_unfused(name, tmp_path, tmp_path_factory):
    """Every equivalence plan (uneven query-group shards, GQA, TP 1-3, tied embeddings) under
    attention_backend auto (and flash, through --use-flash-attn, on a second run in the same
    launch) learns what the one-rank unfused plan learns."""
    model, world, pipelines = PLANS[name]
    ref = reference(tmp_path_factory, model)
    runs = [
        (write_plan(tmp_path, f"{name}-{b}", model, world, pipelines, attention_backend=b), flags)
        for b, flags in (("auto", []), ("flash", ["--use-flash-attn"]))
    ]
    results = run_distributed(train_each, world, runs, timeout=400)[0]
    for (path, flags), result in zip(runs, results):
        loss, norm, param = compare(result, ref)
        print(
            f"{path.stem} {' '.join(flags)}: max relative difference loss {loss:.2e}, grad norm "
            f"{norm:.2e}, parameters {param:.2e}"
        )
        assert loss < TOLERANCE and norm < TOLERANCE and param < TOLERANCE
        assert result["core_attention"] == ["SDPAttention"], result["core_attention"]


def test_reference_is_unfused(tmp_path):
    """The one-rank reference the plans above are compared with computes attention unfused: a
    plan written without the field means unfused, as plans before the field did."""
    from planner.plan import load_plan

    plan = load_plan(write_plan(tmp_path, "ref", "tiny", 1, REFERENCE))
    assert plan.training.attention_backend == "unfused"
    assert "attention_backend" not in plan.to_dict()["training"]
