"""A Megatron-LM Llama-2 launch script's flags, scaled down to the tiny model, run through
pretrain_gpt.py on real preprocessed data: under a heterogeneous plan (a two-stage pipeline beside
a one-stage one, full recompute) they train exactly as under the one-rank plan, with Megatron-LM's
samples-based schedule and warm-up fraction (recomputing by block there, uniformly here). The
run-length flags (--exit-duration-in-mins, --manual-gc, a --load folder with no checkpoint) and
the CUDA-only backend behave as Megatron-LM's.
"""

import json

import pytest

from data.commands import flags as data_flags
from harness import run_ranks, run_script
from runtime.plans import TWO_STAGES, write_plan
from runtime.workers import max_relative_difference

# The hetero plan: pipeline 0 two stages (ranks 0, 1), pipeline 1 one stage (rank 2); both
# micro-batches of 2 (so the script's --micro-batch-size holds), 2 + 2 of them = 8 samples.
HETERO = [
    {
        "micro_batch_size": 2,
        "num_microbatches": 2,
        "stages": [{"ranks": [0], "layers": [0, 2]}, {"ranks": [1], "layers": [2, 4]}],
    },
    {"micro_batch_size": 2, "num_microbatches": 2, "stages": [{"ranks": [2], "layers": [0, 4]}]},
]
ONE_RANK = [
    {"micro_batch_size": 2, "num_microbatches": 4, "stages": [{"ranks": [0], "layers": [0, 4]}]}
]


def llama2_script(corpus, save, recompute=("uniform", "1")):
    """examples/llama2-style flags, as written for Megatron-LM (the tiny model's sizes, a short
    schedule in samples, dropout off as Llama-2's), minus precision and tokenizer type."""
    method, layers = recompute
    return [
        "--use-mcore-models",
        *("--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "256"),
        *("--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "4"),
        *("--seq-length", "32", "--max-position-embeddings", "32"),
        *("--position-embedding-type", "rope", "--rotary-base", "10000"),
        *("--normalization", "RMSNorm", "--norm-epsilon", "1e-5", "--swiglu"),
        *("--disable-bias-linear", "--untie-embeddings-and-output-weights"),
        *("--init-method-std", "0.02", "--attention-dropout", "0.0", "--hidden-dropout", "0.0"),
        *("--use-flash-attn", "--no-masked-softmax-fusion", "--no-bias-dropout-fusion"),
        *("--no-rope-fusion", "--attention-softmax-in-fp32"),
        *("--recompute-granularity", "full", "--recompute-method", method),
        *("--recompute-num-layers", layers),
        *("--micro-batch-size", "2", "--global-batch-size", "8"),
        *("--train-samples", "16", "--lr-decay-samples", "64", "--lr-warmup-fraction", "0.5"),
        *("--lr", "3e-4", "--min-lr", "3e-5", "--lr-decay-style", "cosine"),
        *("--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95"),
        *("--clip-grad", "1.0", "--accumulate-allreduce-grads-in-fp32"),
        *("--make-vocab-size-divisible-by", "128"),
        *data_flags(corpus, corpus.prefix["a"]),
        *("--log-interval", "1", "--log-throughput", "--log-params-norm"),
        *("--timing-log-level", "2", "--no-position-embedding"),
        *("--log-timers-to-tensorboard", "--log-validation-ppl-to-tensorboard"),
        "--log-memory-to-tensorboard",
        *("--eval-interval", "1000", "--eval-iters", "0"),
        *("--save", str(save), "--load", str(save), "--save-interval", "1000"),
        *("--manual-gc", "--manual-gc-interval", "1", "--exit-duration-in-mins", "230"),
        *("--distributed-timeout-minutes", "10", "--seed", "1234"),
    ]


def _train(repo_root, plan, world, corpus, folder, recompute):
    metrics = folder / "metrics.jsonl"
    runs = run_ranks(
        [
            repo_root / "pretrain_gpt.py",
            "--hetero-plan-path",
            plan,
            *llama2_script(corpus, folder / "ckpt", recompute),
            "--hetero-metrics-path",
            metrics,
        ],
        world,
        cwd=repo_root,
    )
    for code, _, err in runs:
        assert code == 0, err
    return runs[0][1], [json.loads(line) for line in metrics.read_text().splitlines()]


def test_llama2_script_under_a_hetero_plan(repo_root, corpus, tmp_path):
    plans = {
        name: write_plan(tmp_path, name, "tiny", world, pipelines, recompute=True,
                         attention_backend="auto")
        for name, world, pipelines in (("hetero", 3, HETERO), ("one", 1, ONE_RANK))
    }  # fmt: skip
    (tmp_path / "hetero").mkdir()
    (tmp_path / "one").mkdir()
    # megatron-core's block method over every layer of each stage (4 at most) recomputes as
    # uniform 1 does: the same numbers
    out, hetero = _train(repo_root, plans["hetero"], 3, corpus, tmp_path / "hetero", ("block", "4"))
    _, one = _train(repo_root, plans["one"], 1, corpus, tmp_path / "one", ("uniform", "1"))
    # 16 samples of a global batch of 8; warm-up 0.5 x 64 / 8 = 4 iterations from 0
    assert [m["iteration"] for m in hetero] == [1, 2]
    assert [m["lr"] for m in hetero] == pytest.approx([3e-4 / 4, 3e-4 / 2], rel=1e-12)
    for h, o in zip(hetero, one, strict=True):
        assert h["lr"] == o["lr"]
        assert max_relative_difference(h["lm_loss"], o["lm_loss"]) < 1e-5, (h, o)
        assert max_relative_difference(h["grad_norm"], o["grad_norm"]) < 1e-5, (h, o)
        assert max_relative_difference(h["params_norm"], o["params_norm"]) < 1e-6, (h, o)
    # --save D --load D on a first run: Megatron-LM's warning, a fresh start, then the save
    assert f"params norm: {hetero[-1]['params_norm']:.3f} |" in out
    assert f"WARNING: no checkpoint in {tmp_path / 'hetero' / 'ckpt'}: starting from" in out
    pointer = tmp_path / "hetero" / "ckpt" / "latest_checkpointed_iteration.txt"
    assert pointer.read_text().strip() == "2"


def test_exit_duration_manual_gc_and_missing_checkpoint(repo_root, tmp_path):
    """--exit-duration-in-mins stops after the first iteration past it and saves it (a first
    run, as --load of an empty folder starts fresh), with --manual-gc collecting every
    iteration; --exit-on-missing-checkpoint turns the empty folder into an error; nccl needs
    CUDA. Mock data; two ranks (two stages) for the stop, one for the errors."""
    flags = ["--mock-data", "--train-iters", "3", "--lr", "1e-3"]
    ckpt, empty = tmp_path / "ckpt", tmp_path / "empty"
    empty.mkdir()
    two = write_plan(tmp_path, "two", "tiny", 2, TWO_STAGES)  # the ranks agree on stopping
    runs = run_ranks(
        [
            *(repo_root / "pretrain_gpt.py", "--hetero-plan-path", two, *flags),
            *("--save", ckpt, "--load", ckpt, "--exit-duration-in-mins", "1e-6"),
            *("--manual-gc", "--manual-gc-interval", "1"),
        ],
        2,
        cwd=repo_root,
    )
    assert [code for code, _, _ in runs] == [0, 0], runs
    out = runs[0][1]
    assert "(--exit-duration-in-mins 1e-06)" in out and "exiting program after" in out, out
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    one = write_plan(tmp_path, "one", "tiny", 1, ONE_RANK)
    base = [repo_root / "pretrain_gpt.py", "--hetero-plan-path", one, *flags]
    code, out, err = run_script(
        [*base, "--load", empty, "--exit-on-missing-checkpoint"], cwd=repo_root
    )
    assert code == 2 and "Traceback" not in err, err
    assert err.splitlines()[-1] == (
        f"pretrain_gpt.py: error: --load {empty} holds no checkpoint "
        f"(--exit-on-missing-checkpoint); give a folder with one, or drop the flag to start fresh"
    )
    code, out, err = run_script([*base, "--distributed-backend", "nccl"], cwd=repo_root)
    assert code == 2 and err.splitlines() == [
        "pretrain_gpt.py: error: --distributed-backend nccl needs CUDA, and this run is on the "
        "CPU (no CUDA device, or --hetero-device cpu); drop the flag (gloo on the CPU) or run "
        "on GPUs"
    ], err


@pytest.mark.parametrize("divisible_by, message", [(128, None), (64, None), (100, "pads to 200")])
def test_padded_tokenizer_vocabulary_must_be_the_plans(corpus, tmp_path, divisible_by, message):
    """--make-vocab-size-divisible-by with real data: the tokenizer's 120 tokens, padded as
    Megatron-LM pads them, must be the plan's 128 (checked where the data is built)."""
    from megatron_hexi.arguments import parse_args, run_config
    from megatron_hexi.data import build_train_dataset
    from megatron_hexi.tokenizer import build_tokenizer
    from planner.errors import SpecError
    from planner.plan import load_plan

    path = write_plan(tmp_path, "one", "tiny", 1, ONE_RANK)
    config = run_config(
        parse_args(
            ["--hetero-plan-path", str(path), "--train-iters", "2", "--lr", "1e-3"]
            + ["--make-vocab-size-divisible-by", str(divisible_by)]
            + data_flags(corpus, corpus.prefix["a"])
        )
    )

    def build():
        return build_train_dataset(
            config.data, load_plan(path), train_iters=2, seed=1234,
            tokenizer=build_tokenizer(config.data),
        )  # fmt: skip

    if message is None:
        assert len(build()) >= 16
        return
    with pytest.raises(SpecError) as e:
        build()
    assert e.value.problems == [
        f"--make-vocab-size-divisible-by {divisible_by}: the tokenizer (120 tokens) pads to 200 "
        f"(a multiple of 100 x TP 1), but the plan's model vocab_size is 128; plan with "
        f"vocab_size 200, or give a value that pads to 128"
    ]
