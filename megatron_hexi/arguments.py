"""Command-line flags: Megatron-LM's names for what is supported, plus the --hetero-* group.

Model and batch flags may be omitted (the plan has them); one that contradicts the plan is an
error, and so is any flag this runtime does not support (it is named, never silently ignored).
The checked flags become a RunConfig (run_config), the only form the runtime reads.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, NoReturn

from megatron_hexi.config import (
    CheckpointConfig,
    DataConfig,
    DropoutConfig,
    EvaluationConfig,
    FusionConfig,
    LoggingConfig,
    LRScheduleConfig,
    OptimizerConfig,
    PrecisionConfig,
    RunConfig,
    RuntimeConfig,
    TrainingConfig,
)
from megatron_hexi.tokenizer import TOKENIZER_FILES, TOKENIZER_TYPES
from planner.attention import ATTENTION_BACKENDS, CLI_DEFAULT_BACKEND
from planner.cli_args import PARAM_GATHER_NEEDS_DISTRIBUTED_OPTIMIZER, cuda_graph_settings
from planner.cluster import ClusterSpec, load_cluster
from planner.cuda_graphs import CUDA_GRAPH_IMPLS, CUDA_GRAPH_SCOPES, PLAN_DEFAULT_GRAPH_IMPL
from planner.errors import SpecError
from planner.membership import PlanningOptions
from planner.models import ModelSpec, load_model
from planner.transformer_impl import TRANSFORMER_IMPLS, default_impl

if TYPE_CHECKING:
    from planner.plan import Plan, Training

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
        "SentencePieceTokenizer: a tokenizer.model",
    )
    d.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: vocab.json")
    d.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: merges.txt")
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


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    flags = [u for u in unknown if u.startswith("--")]
    if flags:
        raise SpecError(
            f"unsupported flag{'s' if len(flags) > 1 else ''}: {' '.join(flags)} "
            f"(this runtime does not implement {'them' if len(flags) > 1 else 'it'}; "
            f"see pretrain_gpt.py --help)"
        )
    if unknown:
        raise SpecError(f"unexpected argument: {' '.join(unknown)}")
    if args.recompute_activations:
        raise SpecError(
            "--recompute-activations (selective recompute) is not supported; use "
            "--recompute-granularity full, or plan with recompute"
        )
    check_ranges(args)
    check_plan_source(args)
    check_split(args.split)
    if not args.mock_data and not args.data_path:
        raise SpecError("give --mock-data or --data-path")
    if args.data_path:
        check_tokenizer_flags(args)
    if args.valid_data_path and not args.data_path:
        raise SpecError("--valid-data-path needs --data-path (and its tokenizer)")
    if args.save_interval and not args.save:
        raise SpecError("--save-interval needs --save DIR")
    loading = ("ckpt_step", "finetune", "no_load_optim", "no_load_rng", "hetero_load_if_exists")
    given = [f for f in loading if getattr(args, f) not in (None, False)]
    if not args.load and given:
        raise SpecError(f"--{given[0].replace('_', '-')} needs --load DIR")
    return args


def check_plan_source(args: argparse.Namespace) -> None:
    """Exactly one of --hetero-plan-path and --hetero-cluster; --hetero-model goes with the
    cluster, and planning needs the global batch."""
    if bool(args.hetero_plan_path) == bool(args.hetero_cluster):
        raise SpecError(
            "give exactly one of --hetero-plan-path PLAN.json (a plan made by hexi-plan) and "
            "--hetero-cluster CLUSTER.yaml (plan at start-up for the nodes present), got "
            + ("both" if args.hetero_plan_path else "neither")
        )
    if args.hetero_cluster and not args.hetero_model:
        raise SpecError(
            "--hetero-cluster needs --hetero-model (a catalog model name or a model YAML)"
        )
    if args.hetero_model and not args.hetero_cluster:
        raise SpecError(
            "--hetero-model goes with --hetero-cluster; a plan file already names its model"
        )
    if args.hetero_cluster and args.global_batch_size is None:
        raise SpecError(
            "--hetero-cluster needs --global-batch-size (the planner searches for that batch)"
        )


@dataclass(frozen=True)
class PlanningInputs:
    """What a start plans from: read and checked before any process group exists."""

    cluster: ClusterSpec
    model: ModelSpec
    options: PlanningOptions


def planning_inputs(args: argparse.Namespace, cuda: bool) -> PlanningInputs:
    """--hetero-cluster, --hetero-model and Megatron's batch and memory flags, as the options
    `hexi-plan plan` takes. Without --recompute-granularity the planner may choose recompute
    (its `auto`): a run that shrinks to fewer nodes may need it to fit. Without
    --transformer-impl, Transformer Engine where this run can use it (`cuda` and TE installed),
    else the local spec (planner.transformer_impl.default_impl)."""
    seq = args.seq_length if args.seq_length is not None else args.max_position_embeddings
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        raise SpecError(PARAM_GATHER_NEEDS_DISTRIBUTED_OPTIMIZER)
    graphs = cuda_graph_settings(
        argparse.Namespace(
            cuda_graph_impl=args.cuda_graph_impl or PLAN_DEFAULT_GRAPH_IMPL,
            cuda_graph_scope=args.cuda_graph_scope,
        )
    )
    return PlanningInputs(
        load_cluster(args.hetero_cluster),
        load_model(args.hetero_model),
        PlanningOptions(
            global_batch_size=args.global_batch_size,
            micro_batch_size=args.micro_batch_size,
            seq_length=seq,
            recompute="on" if args.recompute_granularity == "full" else "auto",
            use_distributed_optimizer=bool(args.use_distributed_optimizer),
            overlap_grad_reduce=bool(args.overlap_grad_reduce),
            overlap_param_gather=bool(args.overlap_param_gather),
            attention_backend=attention_backend(args) or CLI_DEFAULT_BACKEND,
            sequence_parallel=bool(args.sequence_parallel),
            transformer_impl=args.transformer_impl or default_impl(cuda),
            cuda_graph_impl=graphs[0],
            cuda_graph_scope=graphs[1],
        ),
    )


def check_tokenizer_flags(args: argparse.Namespace) -> None:
    """--data-path needs a tokenizer, named with the files its type reads."""
    if args.tokenizer_type is None:
        raise SpecError(
            "--data-path needs --tokenizer-type (one of " + ", ".join(TOKENIZER_TYPES) + ")"
        )
    needs = TOKENIZER_FILES[args.tokenizer_type]
    missing = [f for f in needs if not getattr(args, f.lstrip("-").replace("-", "_"))]
    if missing:
        raise SpecError(f"--tokenizer-type {args.tokenizer_type} needs {' and '.join(missing)}")


def attention_backend(args: argparse.Namespace) -> str | None:
    """--attention-backend, or flash for --use-flash-attn (None: neither given)."""
    if args.use_flash_attn and args.attention_backend not in (None, "flash"):
        raise SpecError(
            f"--use-flash-attn contradicts --attention-backend {args.attention_backend}"
        )
    return "flash" if args.use_flash_attn else args.attention_backend


def cuda_graph_problems(args: argparse.Namespace, t: Training) -> list[str]:
    """--cuda-graph-impl and --cuda-graph-scope against the plan's CUDA graphs: each given flag
    must say what the plan says (a scope given alone speaks of the plan's implementation)."""
    problems = []
    impl, scope = args.cuda_graph_impl, args.cuda_graph_scope
    if impl is not None and impl != t.cuda_graph_impl:
        problems.append(
            f"--cuda-graph-impl {impl} contradicts the plan (cuda_graph_impl: "
            f"{t.cuda_graph_impl}); re-plan with hexi-plan ... --cuda-graph-impl {impl}"
        )
    if scope is not None and (tuple(scope) != t.cuda_graph_scope or t.cuda_graph_impl == "none"):
        planned = " ".join(t.cuda_graph_scope) or "whole layers"
        problems.append(
            f"--cuda-graph-scope {' '.join(scope)} contradicts the plan (cuda_graph_impl: "
            f"{t.cuda_graph_impl}, cuda_graph_scope: {planned}); re-plan with hexi-plan ... "
            f"--cuda-graph-impl IMPL --cuda-graph-scope {' '.join(scope)}"
        )
    return problems


def check_against_plan(args: argparse.Namespace, plan: Plan) -> None:
    """Every given flag must agree with the plan; returns nothing, raises SpecError otherwise."""
    m = plan.model
    problems = []
    for flag, field in MODEL_FLAGS.items():
        given = getattr(args, flag)
        if given is not None and given != getattr(m, field):
            problems.append(
                f"--{flag.replace('_', '-')} {given} contradicts the plan's model "
                f"{field} {getattr(m, field)}"
            )
    if args.swiglu is not None and args.swiglu != m.swiglu:
        problems.append(f"--swiglu contradicts the plan's model (swiglu: {m.swiglu})")
    if (
        args.untie_embeddings_and_output_weights is not None
        and not m.untie_embeddings_and_output_weights
    ):
        problems.append(
            "--untie-embeddings-and-output-weights contradicts the plan's model (tied embeddings)"
        )
    if args.normalization is not None and args.normalization != m.normalization:
        problems.append(
            f"--normalization {args.normalization} contradicts the plan's {m.normalization}"
        )
    if args.disable_bias_linear is not None and m.add_bias_linear:
        problems.append("--disable-bias-linear contradicts the plan's model (add_bias_linear)")
    if args.global_batch_size is not None and args.global_batch_size != plan.global_batch_size:
        problems.append(
            f"--global-batch-size {args.global_batch_size} contradicts the plan's "
            f"global_batch_size {plan.global_batch_size}"
        )
    sizes = sorted({p.micro_batch_size for p in plan.pipelines})
    if args.micro_batch_size is not None and sizes != [args.micro_batch_size]:
        problems.append(
            f"--micro-batch-size {args.micro_batch_size} contradicts the plan's "
            f"micro-batch sizes {sizes}"
        )
    tps = sorted({s.tp_size for p in plan.pipelines for s in p.stages})
    if args.tensor_model_parallel_size is not None and tps != [args.tensor_model_parallel_size]:
        problems.append(
            f"--tensor-model-parallel-size {args.tensor_model_parallel_size} "
            f"contradicts the plan's TP degrees {tps}"
        )
    pps = sorted({len(p.stages) for p in plan.pipelines})
    if args.pipeline_model_parallel_size is not None and pps != [args.pipeline_model_parallel_size]:
        problems.append(
            f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size} "
            f"contradicts the plan's stage counts {pps}"
        )
    t = plan.training
    if args.use_distributed_optimizer and not t.use_distributed_optimizer:
        problems.append(
            "--use-distributed-optimizer contradicts the plan (use_distributed_"
            "optimizer: false); re-plan with hexi-plan ... --use-distributed-optimizer"
        )
    shard = args.hetero_optimizer_shard
    if shard is not None and (not t.use_distributed_optimizer or shard != t.optimizer_shard):
        problems.append(
            f"--hetero-optimizer-shard {shard} contradicts the plan "
            f"(use_distributed_optimizer: {str(t.use_distributed_optimizer).lower()}, "
            f"optimizer_shard: {t.optimizer_shard})"
        )
    for flag, field in (
        ("--overlap-grad-reduce", "overlap_grad_reduce"),
        ("--overlap-param-gather", "overlap_param_gather"),
        ("--sequence-parallel", "sequence_parallel"),
    ):
        if getattr(args, field) and not getattr(t, field):
            problems.append(
                f"{flag} contradicts the plan ({field}: false); re-plan with hexi-plan ... {flag}"
            )
    backend = attention_backend(args)
    if backend is not None and backend != t.attention_backend:
        problems.append(
            f"--attention-backend {backend} contradicts the plan (attention_backend: "
            f"{t.attention_backend}); re-plan with hexi-plan ... --attention-backend {backend}"
        )
    impl = args.transformer_impl
    if impl is not None and impl != t.transformer_impl:
        problems.append(
            f"--transformer-impl {impl} contradicts the plan (transformer_impl: "
            f"{t.transformer_impl}); re-plan with hexi-plan ... --transformer-impl {impl}"
        )
    problems.extend(cuda_graph_problems(args, t))
    wants_recompute = args.recompute_granularity == "full"
    if args.recompute_granularity is not None and wants_recompute != plan.training.recompute:
        problems.append("--recompute-granularity full contradicts the plan (recompute: false)")
    if problems:
        raise SpecError(problems)


# Flags that never reach the runtime as values: the plan decides what they describe (the flags
# are only checked against it, check_against_plan), or they accept Megatron-LM's one supported
# value. Every other flag maps onto a RunConfig field (run_config; tests check both lists).
NOT_IN_RUN_CONFIG = frozenset(
    {
        "hetero_plan_path",  # read into the Plan itself
        "hetero_cluster",  # planned into the Plan at start-up
        "hetero_model",
        *MODEL_FLAGS,
        "group_query_attention",
        "swiglu",
        "untie_embeddings_and_output_weights",
        "normalization",
        "position_embedding_type",
        "disable_bias_linear",
        "recompute_activations",
        "recompute_granularity",
        "recompute_method",
        "recompute_num_layers",
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "micro_batch_size",
        "global_batch_size",
        "use_distributed_optimizer",
        "hetero_optimizer_shard",
        "overlap_grad_reduce",
        "overlap_param_gather",
        "attention_backend",
        "use_flash_attn",
        "sequence_parallel",
        "transformer_impl",
        "cuda_graph_impl",
        "cuda_graph_scope",
        "optimizer",  # adam only
    }
)


def run_config(args: argparse.Namespace) -> RunConfig:
    """The parsed flags (parse_args) as a RunConfig: the one place a flag reaches the runtime."""
    return RunConfig(
        training=TrainingConfig(
            train_iters=args.train_iters,
            seed=args.seed,
            exit_interval=args.exit_interval,
            exit_signal_handler=args.exit_signal_handler,
            check_for_nan_in_loss_and_grad=args.check_for_nan_in_loss_and_grad,
        ),
        evaluation=EvaluationConfig(
            eval_interval=args.eval_interval,
            eval_iters=args.eval_iters,
            skip_train=args.skip_train,
        ),
        optimizer=OptimizerConfig(
            lr=args.lr,
            min_lr=args.min_lr,
            weight_decay=args.weight_decay,
            adam_beta1=args.adam_beta1,
            adam_beta2=args.adam_beta2,
            adam_eps=args.adam_eps,
            clip_grad=args.clip_grad,
        ),
        lr_schedule=LRScheduleConfig(
            lr_decay_style=args.lr_decay_style,
            lr_decay_iters=args.lr_decay_iters,
            lr_warmup_iters=args.lr_warmup_iters,
            lr_warmup_init=args.lr_warmup_init,
        ),
        precision=PrecisionConfig(bf16=args.bf16),
        dropout=DropoutConfig(
            attention_dropout=args.attention_dropout, hidden_dropout=args.hidden_dropout
        ),
        data=DataConfig(
            mock_data=args.mock_data,
            data_path=None if args.data_path is None else tuple(args.data_path),
            split=args.split,
            data_cache_path=args.data_cache_path,
            tokenizer_type=args.tokenizer_type,
            tokenizer_model=args.tokenizer_model,
            vocab_file=args.vocab_file,
            merge_file=args.merge_file,
            valid_data_path=None if args.valid_data_path is None else tuple(args.valid_data_path),
        ),
        checkpoint=CheckpointConfig(
            save=args.save,
            save_interval=args.save_interval,
            load=args.load,
            load_if_exists=args.hetero_load_if_exists,
            ckpt_step=args.ckpt_step,
            finetune=args.finetune,
            no_load_optim=args.no_load_optim,
            no_load_rng=args.no_load_rng,
            override_opt_param_scheduler=args.override_opt_param_scheduler,
            use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        ),
        logging=LoggingConfig(
            log_interval=args.log_interval,
            log_throughput=args.log_throughput,
            metrics_path=args.hetero_metrics_path,
            tensorboard_dir=args.tensorboard_dir,
            tensorboard_log_interval=args.tensorboard_log_interval,
            wandb_project=args.wandb_project,
            wandb_exp_name=args.wandb_exp_name,
            wandb_save_dir=args.wandb_save_dir,
        ),
        runtime=RuntimeConfig(
            device=args.hetero_device,
            distributed_backend=args.distributed_backend,
            distributed_timeout_minutes=args.distributed_timeout_minutes,
            ddp_bucket_size=args.ddp_bucket_size,
        ),
        fusions=FusionConfig(
            bias_activation_fusion=args.bias_swiglu_fusion and args.bias_gelu_fusion,
            bias_dropout_fusion=args.bias_dropout_fusion,
            apply_rope_fusion=args.apply_rope_fusion,
            masked_softmax_fusion=args.masked_softmax_fusion,
            gradient_accumulation_fusion=args.gradient_accumulation_fusion,
            cross_entropy_loss_fusion=args.cross_entropy_loss_fusion,
        ),
    )
