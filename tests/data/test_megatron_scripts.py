"""Megatron-LM's own launch scripts, as written, train under a heterogeneous plan: the flag lists of
examples/gpt3/train_gpt3_175b_distributed.sh (GPT-2 BPE, fp16 with its default loss scaling,
learned positions, LayerNorm, GELU, biases) and of a Llama-2 pretraining script (Llama2Tokenizer,
bf16, SwiGLU, RMSNorm, rotary positions, grouped-query attention, no biases), the shapes scaled
down, the data made here by tools/preprocess_data.py. Only --hetero-plan-path is added, and the
three flags a plan fixes (--rampup-batch-size, --ckpt-format, --use-checkpoint-args) are left out.

Per script, three launches of pretrain_gpt.py: the one-rank plan (the reference), then the
heterogeneous plan (uneven TP shards) stopping early with a checkpoint, and the same plan resuming
it to the end. Every training and validation loss of the two equals the reference's. A fourth
runs the GPT-3 script's words alone (EXACT below says what the three others add).
docs/megatron-scripts.md's example command is GPT3_SCRIPT, checked here word for word.
"""

import json
import re
import shlex
import subprocess
import sys

import pytest
import yaml

from data.corpus import train_gpt2_files, train_sentencepiece
from harness import run_ranks, run_script
from runtime.plans import write_plan
from runtime.workers import max_relative_difference

# examples/gpt3/train_gpt3_175b_distributed.sh, in its order, the shapes scaled down (96 layers of
# 12288 with 96 heads over 2048 tokens: 4 of 64 with 4 heads over 32), the schedule too (500000
# iterations of 1536 sequences: 3 of 8; decay over 4300, so the warm-up fraction .001 is 4.3
# iterations), TP 8 x PP 16: 2 x 2, --eval-iters 10: 2. --rampup-batch-size is left out.
GPT3_SCRIPT = """\
pretrain_gpt.py \\
    --num-layers 4 \\
    --hidden-size 64 \\
    --num-attention-heads 4 \\
    --seq-length 32 \\
    --max-position-embeddings 32 \\
    --attention-backend auto \\
    --micro-batch-size 1 \\
    --global-batch-size 8 \\
    --train-iters 3 \\
    --weight-decay 0.1 \\
    --adam-beta1 0.9 \\
    --adam-beta2 0.95 \\
    --init-method-std 0.006 \\
    --clip-grad 1.0 \\
    --fp16 \\
    --lr 6.0e-5 \\
    --lr-decay-style cosine \\
    --min-lr 6.0e-6 \\
    --lr-warmup-fraction .001 \\
    --lr-decay-iters 4300 \\
    --tensor-model-parallel-size 2 \\
    --pipeline-model-parallel-size 2 \\
    --data-path $DATA_PATH \\
    --vocab-file $VOCAB_FILE \\
    --merge-file $MERGE_FILE \\
    --tokenizer-type GPT2BPETokenizer \\
    --split 949,50,1 \\
    --log-interval 1 \\
    --save-interval 10000 \\
    --eval-interval 1000 \\
    --save $CHECKPOINT_PATH \\
    --load $CHECKPOINT_PATH \\
    --eval-iters 2 \\
    --tensorboard-dir $TENSORBOARD_LOGS_PATH \\
    --hetero-plan-path $PLAN
"""

# The plan's model file for GPT3_SCRIPT: Megatron-LM's GPT defaults (tied embeddings, 4 x hidden
# FFN, LayerNorm, GELU, biases, a learned position table), the script's init std.
GPT3_MODEL = {
    "num_layers": 4,
    "hidden_size": 64,
    "ffn_hidden_size": 256,
    "num_attention_heads": 4,
    "num_query_groups": 4,
    "vocab_size": 128,
    "seq_length": 32,
    "swiglu": False,
    "untie_embeddings_and_output_weights": False,
    "normalization": "LayerNorm",
    "position_embedding_type": "learned_absolute",
    "add_bias_linear": True,
    "init_method_std": 0.006,
}
# Two pipelines of two TP-2 stages (the script's TP 2 x PP 2), cut at different layers, every
# stage's shards uneven in another way; micro-batches of 1 (the script's), 4 per pipeline.
GPT3_HETERO = [
    {
        "micro_batch_size": 1,
        "num_microbatches": 4,
        "stages": [
            {
                "ranks": [0, 1],
                "layers": [0, 3],
                "shards": {"query_groups": [3, 1], "ffn": [192, 64], "vocab": [96, 32]},
            },
            {"ranks": [2, 3], "layers": [3, 4], "shards": {"vocab": [80, 48]}},
        ],
    },
    {
        "micro_batch_size": 1,
        "num_microbatches": 4,
        "stages": [
            {"ranks": [4, 5], "layers": [0, 1], "shards": {"query_groups": [1, 3]}},
            {"ranks": [6, 7], "layers": [1, 4], "shards": {"ffn": [100, 156]}},
        ],
    },
]


# fp16's dynamic loss scale starts here, not at 2^32: from 2^32 it halves on each overflow, and
# the first scale that does not overflow is this model's edge of the fp16 range, where whether a
# gradient element passes 65504 depends on where its partial sums are formed. Measured: the
# one-rank plan first steps at 2048 (iteration 23), the 8-rank plan already at 4096 (22); each
# then trains a different run. From 2048 both step from iteration 1.
# With dropout (Megatron-LM's default 0.1 is the script's), each plan draws its own masks: a
# tensor cut into other shards takes other random numbers, so runs agree in distribution only.
# The test appends both to the script, which is otherwise run as written.
EXACT = ["--initial-loss-scale", "2048", "--attention-dropout", "0.0", "--hidden-dropout", "0.0"]
# Tolerances, relative to the one-rank plan's run in the same precision. fp16 (11-bit mantissa)
# and bf16 (8-bit) round every activation and weight, and the plans sum in other orders (uneven
# TP shards, other pipeline cuts, the tied embedding's two gradients summed in fp32 across stages
# or in the one tensor). Measured: fp16 loss 6.8e-7, grad norm 4.5e-5, validation loss 2.2e-7;
# bf16 loss 7.2e-6, grad norm 8.2e-5, validation loss 6.2e-6. The loss bounds are 1e-5 (fp16
# with a margin of 15x; bf16's rounding leaves 1.4x, deterministic on the CPU); the grad norm
# bounds 5e-4, runtime/test_fp16.py's for fp16. Less than a defect moves them: other dropout
# masks alone (this test with dropout on) put the GPT-3 run's first loss 2.4e-5 and its first
# grad norm 1.1e-2 away, and a gradient left scaled would be 2048x off.
FP16_LOSS, FP16_NORM = 1e-5, 5e-4
BF16_LOSS, BF16_NORM = 1e-5, 5e-4


def one_rank(micro_batch_size):
    return [
        {
            "micro_batch_size": micro_batch_size,
            "num_microbatches": 8 // micro_batch_size,
            "stages": [{"ranks": [0], "layers": [0, 4]}],
        }
    ]


def llama2_script(tokenizer_model, data_path, ckpt, train_iters):
    """The flags of a Llama-2 pretraining script for Megatron-LM (Megatron-LM's Llama/Mistral
    docs and its examples/llama Llama-2 script): 8 heads in 4 query groups for Llama-2-70B's 64
    in 8, the tiny model's other shapes, a schedule of a few iterations, --split 99990,8,2 as
    90,8,2 (44 documents: the validation part must hold one). Without
    --tensor-model-parallel-size and --pipeline-model-parallel-size: the plan's stages differ in
    both, and --ckpt-format / --use-checkpoint-args are left out."""
    return [
        "--use-mcore-models",
        *("--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "192"),
        *("--num-attention-heads", "8", "--seq-length", "32", "--max-position-embeddings", "32"),
        "--untie-embeddings-and-output-weights",
        *("--position-embedding-type", "rope", "--no-position-embedding"),
        "--use-rotary-position-embeddings",
        *("--swiglu", "--disable-bias-linear", "--init-method-std", "0.02"),
        *("--attention-dropout", "0.0", "--hidden-dropout", "0.0"),
        *("--normalization", "RMSNorm", "--norm-epsilon", "1e-5"),
        *("--micro-batch-size", "2", "--global-batch-size", "8"),
        *("--train-iters", str(train_iters), "--bf16", "--no-masked-softmax-fusion"),
        *("--no-rope-fusion", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion"),
        *("--lr", "1e-4", "--min-lr", "1e-5", "--lr-decay-iters", "320"),
        *("--lr-decay-style", "cosine", "--lr-warmup-iters", "2"),
        *("--weight-decay", "1.0e-1", "--clip-grad", "1.0", "--optimizer", "adam"),
        *("--adam-beta1", "0.9", "--adam-beta2", "0.95"),
        *("--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", str(tokenizer_model)),
        *("--data-path", str(data_path), "--split", "90,8,2"),
        *("--save-interval", "200000", "--log-interval", "1", "--log-throughput"),
        *("--eval-interval", "320000", "--eval-iters", "2"),
        *("--save", str(ckpt), "--load", str(ckpt)),
        *("--group-query-attention", "--num-query-groups", "4"),
        "--no-gradient-accumulation-fusion",
        *("--distributed-timeout-minutes", "120", "--use-flash-attn"),
        "--attention-softmax-in-fp32",
        *("--manual-gc", "--exit-duration-in-mins", "235"),
    ]


# The Llama-2 plan: a TP-2 stage (uneven query groups and FFN) before a TP-1 stage, beside a
# one-stage pipeline; micro-batches of 2 (the script's), 2 per pipeline.
LLAMA2_HETERO = [
    {
        "micro_batch_size": 2,
        "num_microbatches": 2,
        "stages": [
            {
                "ranks": [0, 1],
                "layers": [0, 3],
                "shards": {"query_groups": [3, 1], "ffn": [100, 92], "vocab": [72, 48]},
            },
            {"ranks": [2], "layers": [3, 4]},
        ],
    },
    {"micro_batch_size": 2, "num_microbatches": 2, "stages": [{"ranks": [3], "layers": [0, 4]}]},
]


@pytest.fixture(scope="module")
def files(corpus, tmp_path_factory, repo_root):
    """GPT-2 BPE files and a SentencePiece tokenizer.model trained on the corpus, and corpus "a"
    preprocessed with each by tools/preprocess_data.py (both at once)."""
    d = tmp_path_factory.mktemp("scripts")
    train_gpt2_files(d / "gpt2")
    train_sentencepiece(d / "tokenizer.model")
    gpt2 = ["--vocab-file", d / "gpt2/vocab.json", "--merge-file", d / "gpt2/merges.txt"]
    llama2 = ["--tokenizer-model", d / "tokenizer.model"]
    commands = {
        "gpt2": ["--tokenizer-type", "GPT2BPETokenizer", *gpt2],
        "llama2": ["--tokenizer-type", "Llama2Tokenizer", *llama2],
    }
    running = {
        name: subprocess.Popen(
            [
                sys.executable,
                repo_root / "tools/preprocess_data.py",
                *("--input", corpus.jsonl["a"], "--output-prefix", d / name, "--append-eod"),
                *flags,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=repo_root,
        )
        for name, flags in commands.items()
    }
    for name, proc in running.items():
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, f"{name}: {err}"
    return {
        "dir": d,
        "vocab": d / "gpt2/vocab.json",
        "merges": d / "gpt2/merges.txt",
        "model": d / "tokenizer.model",
        "gpt2": d / "gpt2_text_document",
        "llama2": d / "llama2_text_document",
    }


def gpt3_argv(files, plan, ckpt, tensorboard, train_iters, layout=True, exact=True):
    """GPT3_SCRIPT's words with the paths filled in and --train-iters set; without `layout`,
    less --tensor-model-parallel-size and --pipeline-model-parallel-size (checked against the
    plan, so a one-rank plan refuses the script's 2 and 2; they change nothing else); without
    `exact`, without EXACT: GPT3_SCRIPT's words alone."""
    values = {
        "$DATA_PATH": files["gpt2"],
        "$VOCAB_FILE": files["vocab"],
        "$MERGE_FILE": files["merges"],
        "$CHECKPOINT_PATH": ckpt,
        "$TENSORBOARD_LOGS_PATH": tensorboard,
        "$PLAN": plan,
    }
    words = [str(values.get(w, w)) for w in shlex.split(GPT3_SCRIPT.replace("\\\n", " "))]
    words[words.index("--train-iters") + 1] = str(train_iters)
    if exact:
        words += EXACT
    if not layout:
        for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size"):
            i = words.index(flag)
            del words[i : i + 2]
    return words


def _launch(repo_root, argv, world, metrics):
    runs = run_ranks(
        [repo_root / argv[0], *argv[1:], "--hetero-metrics-path", metrics],
        world,
        timeout=600,
        cwd=repo_root,
    )
    for code, _, err in runs:
        assert code == 0, err
    return runs[0][1]


def _records(metrics):
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    train = {m["iteration"]: m for m in lines if "lm_loss" in m}
    evals = {m["iteration"]: m["eval_lm_loss"] for m in lines if "eval_lm_loss" in m}
    return train, evals


def _train_three_ways(repo_root, argv_for, plan_for, world, stop, end, tmp_path):
    """(reference, heterogeneous) records: the one-rank plan to `end`; the heterogeneous plan
    to `stop`, saving, then resumed from that checkpoint to `end` (one metrics file)."""
    out = {}
    for name in ("one", "hetero"):
        folder = tmp_path / name
        folder.mkdir()
        metrics = folder / "metrics.jsonl"
        if name == "one":
            _launch(repo_root, argv_for(plan_for["one"], folder, end), 1, metrics)
        else:
            first = _launch(repo_root, argv_for(plan_for["hetero"], folder, stop), world, metrics)
            assert "no checkpoint in" in first  # --load of an empty folder: a fresh start
            pointer = folder / "ckpt" / "latest_checkpointed_iteration.txt"
            assert pointer.read_text().strip() == str(stop)
            resumed = _launch(repo_root, argv_for(plan_for["hetero"], folder, end), world, metrics)
            loaded = f"loaded checkpoint from {folder / 'ckpt' / f'iter_{stop:07d}'} at iteration"
            assert f"{loaded} {stop} in" in resumed, resumed
        out[name] = _records(metrics)
    return out["one"], out["hetero"]


def _compare(one, hetero, stop, end, loss_tol, norm_tol):
    """Largest relative differences (loss, grad norm, validation loss) over every iteration."""
    (one_train, one_eval), (het_train, het_eval) = one, hetero
    assert sorted(one_train) == sorted(het_train) == list(range(1, end + 1))
    loss = norm = 0.0
    for it in range(1, end + 1):
        o, h = one_train[it], het_train[it]
        assert (h["lr"], h["success"], h["loss_scale"]) == (o["lr"], o["success"], o["loss_scale"])
        loss = max(loss, max_relative_difference(h["lm_loss"], o["lm_loss"]))
        if o["success"]:
            norm = max(norm, max_relative_difference(h["grad_norm"], o["grad_norm"]))
    # the heterogeneous run also evaluated at its stop (the end of its first launch)
    assert sorted(one_eval) == [end] and sorted(het_eval) == [stop, end]
    valid = max(max_relative_difference(het_eval[i], one_eval[i]) for i in one_eval)
    print(f"loss {loss:.2e}, grad norm {norm:.2e}, validation loss {valid:.2e}")
    assert loss < loss_tol and valid < loss_tol and norm < norm_tol, (loss, norm, valid)
    return loss, norm, valid


def test_gpt3_script_under_a_hetero_plan(repo_root, files, tmp_path):
    """GPT3_SCRIPT (and EXACT) under 8 ranks (two TP-2 x PP-2 pipelines, uneven shards) against
    one rank (without the two parallel-size flags, which one rank contradicts); every step is
    taken at loss scale 2048, and TensorBoard files are written."""
    model = tmp_path / "gpt3-tiny.yaml"
    model.write_text(yaml.safe_dump(GPT3_MODEL))
    plans = {
        name: write_plan(tmp_path, name, str(model), world, pipelines, attention_backend="auto")
        for name, world, pipelines in (("hetero", 8, GPT3_HETERO), ("one", 1, one_rank(1)))
    }

    def argv(plan, folder, iters):
        layout = plan == plans["hetero"]
        return gpt3_argv(files, plan, folder / "ckpt", folder / "tb", iters, layout)

    one, hetero = _train_three_ways(repo_root, argv, plans, 8, 2, 3, tmp_path)
    taken = [it for it, m in one[0].items() if m["success"]]
    assert taken == [1, 2, 3]  # steps taken before and after the resume
    _compare(one, hetero, 2, 3, FP16_LOSS, FP16_NORM)
    assert list((tmp_path / "hetero" / "tb").iterdir())  # --tensorboard-dir: event files
    # GPT3_SCRIPT alone, as the docs show it: fp16 from Megatron-LM's loss scale 2^32 overflows,
    # and each step is skipped on every rank; hysteresis 2 keeps the scale after the first
    # overflow and halves it after each later one; the lr schedule waits for a taken step.
    folder = tmp_path / "as-written"
    folder.mkdir()
    argv = gpt3_argv(files, plans["hetero"], folder / "ckpt", folder / "tb", 3, exact=False)
    assert len(argv) == len(shlex.split(GPT3_SCRIPT.replace("\\\n", " ")))
    _launch(repo_root, argv, 8, folder / "metrics.jsonl")
    train, evals = _records(folder / "metrics.jsonl")
    assert [(m["success"], m["loss_scale"], m["lr"], m["grad_norm"]) for m in train.values()] == [
        (False, 2.0**32, 0.0, None),
        (False, 2.0**31, 0.0, None),
        (False, 2.0**30, 0.0, None),
    ]
    assert sorted(evals) == [3]


def test_llama2_script_under_a_hetero_plan(repo_root, files, tmp_path):
    """The Llama-2 flags in bf16 under 4 ranks (TP 2 then 1, beside TP 1) against one rank."""
    plans = {
        name: write_plan(tmp_path, name, "tiny-gqa", world, pipelines, attention_backend="auto")
        for name, world, pipelines in (("hetero", 4, LLAMA2_HETERO), ("one", 1, one_rank(2)))
    }

    def argv(plan, folder, iters):
        flags = llama2_script(files["model"], files["llama2"], folder / "ckpt", iters)
        return ["pretrain_gpt.py", "--hetero-plan-path", str(plan), *flags]

    one, hetero = _train_three_ways(repo_root, argv, plans, 4, 2, 3, tmp_path)
    _compare(one, hetero, 2, 3, BF16_LOSS, BF16_NORM)


def test_plan_fixed_flags_are_refused_one_line_each(repo_root, files, tmp_path):
    """The flags left out of the scripts above (and the newer GPT-3 script's replacement of
    --rampup-batch-size): each given is one line saying why, and nothing runs (the whole command
    line is checked before torch is imported)."""
    plan = write_plan(tmp_path, "one", "tiny", 1, one_rank(1))
    code, out, err = run_script(
        [
            *(repo_root / "pretrain_gpt.py", "--hetero-plan-path", plan, "--mock-data"),
            *("--train-iters", "1", "--lr", "1e-4"),
            *("--rampup-batch-size", "16", "16", "5859375", "--ckpt-format", "torch_dist"),
            "--use-checkpoint-args",
            *("--step-batch-size-schedule", "0:16 2.4B:320 4.8B:624"),
        ],
        cwd=repo_root,
    )
    lines = err.splitlines()
    assert code == 2 and "Traceback" not in err, err
    for flag, why in (
        ("--rampup-batch-size", "a plan fixes the global batch size for the whole run"),
        ("--ckpt-format", "checkpoints are this runtime's own per-rank format"),
        ("--use-checkpoint-args", "the plan fixes the model and the batch, not the checkpoint"),
        ("--step-batch-size-schedule", "a plan fixes the global batch size for the whole run"),
    ):
        start = f"pretrain_gpt.py: error: {flag} is refused: {why}"
        assert sum(line.startswith(start) for line in lines) == 1, err
    assert len(lines) == 4, err


def test_docs_show_the_tested_script(repo_root):
    """docs/megatron-scripts.md's example is GPT3_SCRIPT as run above."""
    text = (repo_root / "docs" / "megatron-scripts.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    assert GPT3_SCRIPT in blocks, "docs/megatron-scripts.md: the example is not GPT3_SCRIPT"


def test_no_mmap_bin_files_reads_the_same_samples(files, tmp_path):
    """--no-mmap-bin-files (Megatron-LM's Llama scripts give it): megatron-core reads the .bin
    with file reads instead of a memory map, and every training sample is the same."""
    import numpy as np

    from megatron_hexi.arguments import parse_args, run_config
    from megatron_hexi.data import build_train_dataset
    from megatron_hexi.tokenizer import build_tokenizer
    from planner.plan import load_plan

    plan = write_plan(tmp_path, "one", "tiny-gqa", 1, one_rank(2))
    data = ["--data-path", str(files["llama2"]), "--split", "90,8,2"]
    data += ["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", str(files["model"])]
    samples = {}
    for mmap in (True, False):
        flags = ["--hetero-plan-path", str(plan), "--train-iters", "4", "--lr", "1e-4", *data]
        flags += ["--data-cache-path", str(tmp_path / f"cache-{mmap}")]
        config = run_config(parse_args(flags + ([] if mmap else ["--no-mmap-bin-files"])))
        assert config.data.mmap_bin_files is mmap
        dataset = build_train_dataset(
            config.data, load_plan(plan), train_iters=4, seed=1234,
            tokenizer=build_tokenizer(config.data),
        )  # fmt: skip
        bins = {d.dataset.bin_reader.__class__.__name__ for d in _gpt_datasets(dataset)}
        assert bins == {"_MMapBinReader" if mmap else "_FileBinReader"}, bins
        samples[mmap] = np.stack([dataset[i]["tokens"].numpy() for i in range(len(dataset))])
    assert len(samples[True]) >= 32 and np.array_equal(samples[True], samples[False])


def _gpt_datasets(dataset):
    """The GPTDatasets under a (possibly blended) megatron-core dataset."""
    return getattr(dataset, "datasets", None) or [dataset]
