"""The flags pretrain_gpt.py accepts: Megatron-LM's names for what is supported, plus the
--hetero-* group (`build_parser`), and the checks a flag needs on its own (numeric ranges, the
--split syntax). megatron_hexi.arguments checks them together and against the plan.
"""

from __future__ import annotations

import argparse
import math
import re
from typing import NamedTuple, NoReturn

from megatron_hexi.tokenizer import TOKENIZER_TYPES
from planner.attention import ATTENTION_BACKENDS
from planner.cuda_graphs import CUDA_GRAPH_IMPLS, CUDA_GRAPH_SCOPES
from planner.errors import SpecError
from planner.transformer_impl import TRANSFORMER_IMPLS

# Megatron flag -> plan model field, for the contradiction check.
MODEL_FLAGS = {
    "num_layers": "num_layers",
    "hidden_size": "hidden_size",
    "ffn_hidden_size": "ffn_hidden_size",
    "num_attention_heads": "num_attention_heads",
    "num_query_groups": "num_query_groups",
    "seq_length": "seq_length",
    "max_position_embeddings": "seq_length",
    "kv_channels": "head_dim",
    "norm_epsilon": "norm_epsilon",
    "rotary_base": "rotary_base",
}


def finite_float(text: str) -> float:
    """argparse type: a float that is finite (`nan`, `inf` and `1e999` are refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is a SpecError: one `pretrain_gpt.py: error:` line, exit 2."""

    def error(self, message: str) -> NoReturn:
        raise SpecError(message)


class Range(NamedTuple):
    """Allowed values of a numeric flag: [low, high], either end open or absent."""

    low: float
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def describe(self) -> str:
        low = f"{'>' if self.low_open else '>='} {self.low}"
        if self.high is None:
            return low
        return f"{low} and {'<' if self.high_open else '<='} {self.high}"

    def holds(self, value: float) -> bool:
        above = value > self.low or (value == self.low and not self.low_open)
        below = (
            self.high is None or value < self.high or (value == self.high and not self.high_open)
        )
        return above and below


RANGES = {
    "lr": Range(0),
    "min_lr": Range(0),
    "lr_warmup_init": Range(0),
    "weight_decay": Range(0),
    "clip_grad": Range(0),
    "adam_beta1": Range(0, 1, high_open=True),
    "adam_beta2": Range(0, 1, high_open=True),
    "adam_eps": Range(0, low_open=True),
    "attention_dropout": Range(0, 1),
    "hidden_dropout": Range(0, 1),
    "norm_epsilon": Range(0, low_open=True),
    "distributed_timeout_minutes": Range(0, low_open=True),
    "train_iters": Range(1),
    "log_interval": Range(1),
    "lr_decay_iters": Range(1),
    "lr_warmup_iters": Range(0),
    "seed": Range(0, 2**32 - 1),
    "micro_batch_size": Range(1),
    "global_batch_size": Range(1),
    "save_interval": Range(1),
    "exit_interval": Range(1),
    "tensorboard_log_interval": Range(1),
    "ckpt_step": Range(0),
    "eval_interval": Range(1),
    "eval_iters": Range(0),
    "ddp_bucket_size": Range(1),
}


def check_ranges(args: argparse.Namespace) -> None:
    """Every numeric flag that is given lies in its range (one line per flag that does not)."""
    problems = [
        f"--{flag.replace('_', '-')} must be {r.describe()}, got {getattr(args, flag)}"
        for flag, r in RANGES.items()
        if getattr(args, flag) is not None and not r.holds(getattr(args, flag))
    ]
    if problems:
        raise SpecError(problems)


SPLIT = re.compile(r"^\s*[0-9.eE+]+(\s*[,/]\s*[0-9.eE+]+){0,2}\s*$")


def check_split(text: str) -> None:
    """--split in Megatron's syntax: up to three non-negative weights (train, valid, test),
    separated by ',' or '/', with a positive sum."""
    parts = re.split(r"\s*[,/]\s*", text.strip()) if SPLIT.match(text) else []
    try:
        weights = [float(x) for x in parts]
    except ValueError:
        weights = []
    if not weights or not all(math.isfinite(w) and w >= 0 for w in weights) or sum(weights) <= 0:
        raise SpecError(
            f"--split {text!r}: give up to three non-negative weights with a "
            f"positive sum, as '969,30,1' or '98/2/0'"
        )


EXAMPLE = """example:
  # plan 4 GPUs of 3 kinds, then train on 4 CPU processes standing in for them
  hexi-plan plan --cluster examples/clusters/mini-hetero.yaml --model tiny \\
      --global-batch-size 8 -o plan.json
  OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 pretrain_gpt.py --hetero-plan-path plan.json \\
      --mock-data --train-iters 20 --lr 1e-3 --lr-decay-style constant \\
      --eval-interval 10 --eval-iters 2 --log-interval 5
"""


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="pretrain_gpt.py",
        allow_abbrev=False,
        description="Train a GPT under a heterogeneous plan.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EXAMPLE,
    )
    h = p.add_argument_group("hetero")
    h.add_argument(
        "--hetero-plan-path",
        default=None,
        help="plan JSON (hexi-plan); or plan at start-up with --hetero-cluster",
    )
    h.add_argument(
        "--hetero-cluster",
        default=None,
        help="cluster YAML: plan at every start for the nodes that run processes (elastic "
        "runs); the batch and memory flags are the planning options",
    )
    h.add_argument(
        "--hetero-model",
        default=None,
        help="with --hetero-cluster: catalog model name or model YAML, as in hexi-plan",
    )
    h.add_argument("--hetero-metrics-path", default=None, help="JSONL metrics per iteration")
    h.add_argument(
        "--hetero-device",
        choices=["cpu", "cuda"],
        default=None,
        help="default: cuda when available, else cpu (GPUs emulated by processes)",
    )
    m = p.add_argument_group("model (optional: taken from the plan)")
    for flag in MODEL_FLAGS:
        kind = finite_float if flag == "norm_epsilon" else int
        m.add_argument("--" + flag.replace("_", "-"), type=kind, default=None)
    m.add_argument("--group-query-attention", action="store_true")
    m.add_argument("--swiglu", action="store_true", default=None)
    m.add_argument("--untie-embeddings-and-output-weights", action="store_true", default=None)
    m.add_argument("--normalization", choices=["RMSNorm", "LayerNorm"], default=None)
    m.add_argument("--position-embedding-type", choices=["rope"], default=None)
    m.add_argument("--disable-bias-linear", action="store_true", default=None)
    m.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        default=None,
        help="the plan's training.attention_backend: auto, flash and fused run torch's fused "
        "attention (no s x s tensor), unfused and local megatron-core's DotProductAttention",
    )
    m.add_argument(
        "--use-flash-attn", action="store_true", default=None, help="as --attention-backend flash"
    )
    m.add_argument(
        "--sequence-parallel",
        action="store_true",
        default=None,
        help="the plan's training.sequence_parallel: megatron-core's sequence parallelism in "
        "every stage with TP > 1",
    )
    m.add_argument(
        "--transformer-impl",
        choices=TRANSFORMER_IMPLS,
        default=None,
        help="the plan's training.transformer_impl: transformer_engine (CUDA and Transformer "
        "Engine) or local (megatron-core's torch layers)",
    )
    m.add_argument(
        "--cuda-graph-impl",
        choices=CUDA_GRAPH_IMPLS,
        default=None,
        help="the plan's training.cuda_graph_impl (CUDA only): local (megatron-core's "
        "per-layer CudaGraphManager), transformer_engine (TE's graphs) or none",
    )
    m.add_argument(
        "--cuda-graph-scope",
        nargs="+",
        choices=CUDA_GRAPH_SCOPES,
        default=None,
        help="the plan's training.cuda_graph_scope: the parts of each layer the graphs capture "
        "(the plan's default: the whole layer)",
    )
    m.add_argument("--attention-dropout", type=finite_float, default=0.1)
    m.add_argument("--hidden-dropout", type=finite_float, default=0.1)
    m.add_argument("--recompute-activations", action="store_true")
    m.add_argument("--recompute-granularity", choices=["full"], default=None)
    m.add_argument("--recompute-method", choices=["uniform"], default=None)
    m.add_argument("--recompute-num-layers", type=int, default=None)
    m.add_argument("--tensor-model-parallel-size", type=int, default=None)
    m.add_argument("--pipeline-model-parallel-size", type=int, default=None)
    b = p.add_argument_group("batch and optimizer")
    b.add_argument("--micro-batch-size", type=int, default=None)
    b.add_argument("--global-batch-size", type=int, default=None)
    b.add_argument("--train-iters", type=int, required=True)
    b.add_argument("--lr", type=finite_float, required=True)
    b.add_argument("--min-lr", type=finite_float, default=0.0)
    b.add_argument(
        "--lr-decay-style",
        choices=["constant", "linear", "cosine", "inverse-square-root"],
        default="linear",
    )
    b.add_argument("--lr-decay-iters", type=int, default=None)
    b.add_argument("--lr-warmup-iters", type=int, default=0)
    b.add_argument("--lr-warmup-init", type=finite_float, default=0.0)
    b.add_argument("--weight-decay", type=finite_float, default=0.01)
    b.add_argument("--adam-beta1", type=finite_float, default=0.9)
    b.add_argument("--adam-beta2", type=finite_float, default=0.999)
    b.add_argument("--adam-eps", type=finite_float, default=1e-8)
    b.add_argument("--clip-grad", type=finite_float, default=1.0)
    b.add_argument("--optimizer", choices=["adam"], default="adam")
    b.add_argument(
        "--use-distributed-optimizer",
        action="store_true",
        default=None,
        help="shard fp32 master weights and Adam state (the plan must assume it)",
    )
    b.add_argument(
        "--hetero-optimizer-shard",
        choices=["even", "memory"],
        default=None,
        help="how optimizer state is cut over a segment's ranks (the plan says)",
    )
    b.add_argument(
        "--overlap-grad-reduce",
        action="store_true",
        default=None,
        help="start each gradient bucket's collective during the last backward pass "
        "(the plan must assume it)",
    )
    b.add_argument(
        "--overlap-param-gather",
        action="store_true",
        default=None,
        help="distributed optimizer: all-gather updated parameters during the next forward "
        "(the plan must assume it)",
    )
    b.add_argument(
        "--ddp-bucket-size",
        type=int,
        default=None,
        metavar="ELEMENTS",
        help="most gradient elements per bucket (default: 40,000,000, Megatron-LM's floor, "
        "with --overlap-grad-reduce; else one bucket per rank set)",
    )
    b.add_argument("--bf16", action="store_true")
    # fp16 with megatron-core's loss scaling: Megatron-LM's flags and defaults (checked in
    # megatron_hexi.arguments.check_precision)
    b.add_argument("--fp16", action="store_true", help="fp16 parameters, with loss scaling")
    b.add_argument(
        "--loss-scale",
        type=finite_float,
        default=None,
        help="constant loss scale (default: dynamic under --fp16)",
    )
    b.add_argument("--initial-loss-scale", type=finite_float, default=2.0**32)
    b.add_argument("--min-loss-scale", type=finite_float, default=1.0)
    b.add_argument(
        "--loss-scale-window",
        type=finite_float,
        default=1000,
        help="steps without inf/NaN before the dynamic scale doubles",
    )
    b.add_argument(
        "--hysteresis",
        type=int,
        default=2,
        help="steps with inf/NaN before the dynamic scale halves",
    )
    b.add_argument("--seed", type=int, default=1234)
    f = p.add_argument_group(
        "fusions (megatron-core's fused kernels: on CUDA each runs where its requirements are "
        "met, the start-up log says which; on CPU all are off)"
    )
    for flag, dest, what in (
        ("--no-bias-swiglu-fusion", "bias_swiglu_fusion", "bias-SwiGLU"),
        ("--no-bias-gelu-fusion", "bias_gelu_fusion", "bias-GELU"),
    ):
        f.add_argument(
            flag,
            action="store_false",
            dest=dest,
            help=f"unfused {what} (the model has one activation: either flag turns its "
            f"bias-activation fusion off)",
        )
    for flag, dest in (
        ("--no-bias-dropout-fusion", "bias_dropout_fusion"),
        ("--no-rope-fusion", "apply_rope_fusion"),
        ("--no-masked-softmax-fusion", "masked_softmax_fusion"),
        ("--no-gradient-accumulation-fusion", "gradient_accumulation_fusion"),
    ):
        f.add_argument(flag, action="store_false", dest=dest)
    f.add_argument(
        "--cross-entropy-loss-fusion",
        action="store_true",
        help="megatron-core's fused cross-entropy (bf16 runs; off by default, as in Megatron-LM)",
    )
    d = p.add_argument_group("data and logging")
    d.add_argument("--mock-data", action="store_true")
    d.add_argument("--data-path", nargs="+", default=None)
    d.add_argument("--split", default="969,30,1")
    d.add_argument("--data-cache-path", default=None)
    d.add_argument(
        "--tokenizer-type",
        choices=TOKENIZER_TYPES,
        default=None,
        help="how --data-path was tokenized (Megatron-LM's names)",
    )
    d.add_argument(
        "--tokenizer-model",
        default=None,
        help="HuggingFaceTokenizer: a tokenizer.json or a model directory; "
        "SentencePieceTokenizer, Llama2Tokenizer: a tokenizer.model; TikTokenizer: its vocab.json",
    )
    d.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: vocab.json")
    d.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: merges.txt")
    from megatron_hexi.tokenizer import add_tokenizer_options

    add_tokenizer_options(d)
    d.add_argument(
        "--log-interval",
        type=int,
        default=1,
        help="print one line every N iterations, averaged over them (as Megatron-LM)",
    )
    d.add_argument(
        "--log-throughput",
        action="store_true",
        help="add the model TFLOP/s per GPU to the iteration line",
    )
    d.add_argument("--distributed-backend", choices=["gloo", "nccl"], default=None)
    d.add_argument(
        "--distributed-timeout-minutes",
        type=finite_float,
        default=10.0,
        help="collective timeout; fractions allowed (a dead or hung peer fails every "
        "rank within it)",
    )
    d.add_argument("--tensorboard-dir", default=None, help="write TensorBoard scalars here")
    d.add_argument("--tensorboard-log-interval", type=int, default=1)
    d.add_argument(
        "--wandb-project", default=None, help="log the TensorBoard scalars to this wandb project"
    )
    d.add_argument("--wandb-exp-name", default=None, help="the wandb run's name")
    d.add_argument(
        "--wandb-save-dir",
        default=None,
        help="where wandb writes (default: SAVE/wandb with --save, else ./wandb)",
    )
    v = p.add_argument_group("validation")
    v.add_argument(
        "--eval-interval",
        type=int,
        default=None,
        help="validation loss every N iterations and at the end of training",
    )
    v.add_argument(
        "--eval-iters",
        type=int,
        default=None,
        help="global batches per evaluation (default 100 when evaluating; 0: none)",
    )
    v.add_argument(
        "--skip-train",
        action="store_true",
        help="evaluate the loaded (or initial) weights without training",
    )
    v.add_argument(
        "--valid-data-path",
        nargs="+",
        default=None,
        help="validation prefixes, as --data-path (default: the validation split of --split)",
    )
    d.add_argument(
        "--no-check-for-nan-in-loss-and-grad",
        action="store_false",
        dest="check_for_nan_in_loss_and_grad",
        help="keep training when the loss or the gradient norm is NaN or infinite "
        "(default: stop with an error, as Megatron-LM does)",
    )
    d.add_argument(
        "--exit-interval",
        type=int,
        default=None,
        help="stop (saving first, with --save) when the iteration is a multiple of it",
    )
    d.add_argument(
        "--exit-signal-handler",
        action="store_true",
        help="on SIGTERM, finish the current step, save (with --save) and exit 0",
    )
    c = p.add_argument_group("checkpoints")
    c.add_argument("--save", default=None, help="checkpoint directory to save to")
    c.add_argument(
        "--save-interval",
        type=int,
        default=None,
        help="save every N iterations (and always at the end with --save)",
    )
    c.add_argument("--load", default=None, help="checkpoint directory to resume from")
    c.add_argument(
        "--ckpt-step",
        type=int,
        default=None,
        help="load this iteration instead of latest_checkpointed_iteration.txt's",
    )
    c.add_argument(
        "--finetune",
        action="store_true",
        help="load weights only: iteration 0, fresh Adam state and RNGs",
    )
    c.add_argument("--no-load-optim", action="store_true", help="do not load Adam state")
    c.add_argument("--no-load-rng", action="store_true", help="do not load RNG states")
    c.add_argument(
        "--override-opt_param-scheduler",
        action="store_true",
        dest="override_opt_param_scheduler",
        help="use this run's lr schedule, not the checkpoint's",
    )
    c.add_argument(
        "--use-checkpoint-opt_param-scheduler",
        action="store_true",
        dest="use_checkpoint_opt_param_scheduler",
        help="use the checkpoint's lr schedule",
    )
    h.add_argument(
        "--hetero-load-if-exists",
        action="store_true",
        help="with --load: start fresh if DIR holds no checkpoint at all (a first run "
        "of a restartable job); a missing or corrupt part of one is still an error",
    )
    return p
