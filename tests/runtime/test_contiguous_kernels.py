"""Every tensor handed to megatron-core's multi-tensor kernels is contiguous.

The gradient norm counts each element once, on the owner of its segment; where a pipeline of
another TP shape cuts `linear_proj` or `linear_fc2` along their input dimension, an owned slice is a
column range, a strided view. apex's and Transformer Engine's fused l2norm/scale kernels refuse
strided tensors; megatron-core's CPU fallback takes them, so on CPU only a strict stand-in shows
the difference. The norm reads those slices in place (grad_sync.global_norm: torch's
`_foreach_norm`, which reads strided tensors one by one); clipping scales the whole gradients
(one `_foreach_mul_`, grad_sync.clip_by_norm_). With clipping active (--clip-grad far below the
norm) the run must still match one rank.
"""

import pytest

from harness import run_distributed
from runtime.plans import REFERENCE, write_plan
from runtime.workers import max_relative_difference, train_strict_kernels

CLIP = ["--clip-grad", "0.05"]
# A segment's norm owner is its lowest rank. Here that is the single-rank pipeline, whose full
# `linear_proj` and `linear_fc2` are cut by the TP=2 stage's uneven column shards (3:1 query
# groups, FFN 192:64), so it owns column slices. Beside it: TP=2 then TP=1, uneven micro-batches.
MODEL, WORLD = "tiny", 4
PIPELINES = [
    {"micro_batch_size": 2, "num_microbatches": 1, "stages": [{"ranks": [0], "layers": [0, 4]}]},
    {
        "micro_batch_size": 1,
        "num_microbatches": 6,
        "stages": [
            {
                "ranks": [1, 2],
                "layers": [0, 3],
                "shards": {"query_groups": [3, 1], "ffn": [192, 64], "vocab": [96, 32]},
            },
            {"ranks": [3], "layers": [3, 4]},
        ],
    },
]
_reference = {}


def clipped_reference(tmp_path_factory, model):
    if model not in _reference:
        path = write_plan(tmp_path_factory.mktemp("ref"), "one-rank", model, 1, REFERENCE)
        _reference[model] = run_distributed(
            train_strict_kernels, 1, path, extra_flags=CLIP, timeout=240
        )[0]
    return _reference[model]


@pytest.mark.parametrize(
    "precision, tolerance", [("fp32", (1e-5, 1e-5, 1e-5)), ("bf16", (1e-3, 1e-2, None))]
)
def test_strict_kernels_column_slices(precision, tolerance, tmp_path, tmp_path_factory):
    """fp32 at the equivalence tolerance; bf16 (megatron-core's Float16 optimizer, norm over the
    fp32 main_grad) against the same fp32 run at bf16 precision."""
    ref = clipped_reference(tmp_path_factory, MODEL)
    flags = CLIP + (["--bf16"] if precision == "bf16" else [])
    result = run_distributed(
        train_strict_kernels,
        WORLD,
        write_plan(tmp_path, precision, MODEL, WORLD, PIPELINES),
        extra_flags=flags,
        timeout=400,
    )[0]
    loss = max(max_relative_difference(a, b) for a, b in zip(result["losses"], ref["losses"]))
    norm = max(
        max_relative_difference(a, b) for a, b in zip(result["grad_norms"], ref["grad_norms"])
    )
    param = max(
        max_relative_difference(result["params"][k], ref["params"][k]) for k in ref["params"]
    )
    print(
        f"{precision}: {result['kernel_calls']} multi-tensor calls on {result['kernel_tensors']} "
        f"tensors, {result['strided_owned_slices']} owned column slices; max relative "
        f"difference loss {loss:.2e}, grad norm {norm:.2e}, parameters {param:.2e}"
    )
    # The plan does hand column slices to the norm, and the stand-in did see the kernels' inputs.
    assert result["strided_owned_slices"] > 0
    assert result["kernel_calls"] > 0 and result["kernel_tensors"] > 0
    # Clipping was active at every step (the norm is the one before clipping).
    assert min(ref["grad_norms"]) > 10 * float(CLIP[1])
    max_loss, max_norm, max_param = tolerance
    assert loss < max_loss and norm < max_norm
    if max_param is not None:
        assert param < max_param
