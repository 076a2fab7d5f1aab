"""Command-line flags parsed and checked together (megatron_hexi.flags defines them), then
against the plan.

Model and batch flags may be omitted (the plan has them); one that contradicts the plan is an
error, and so is any flag this runtime does not support (it is named, never silently ignored).
The checked flags become a RunConfig (run_config), the only form the runtime reads.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

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
from megatron_hexi.tokenizer import TOKENIZER_FILES, TOKENIZER_TYPES, special_tokens_flag
from planner.attention import CLI_DEFAULT_BACKEND
from planner.cli_args import PARAM_GATHER_NEEDS_DISTRIBUTED_OPTIMIZER, cuda_graph_settings
from planner.cli_islands import island_request
from planner.cluster import ClusterSpec, load_cluster
from planner.cuda_graphs import PLAN_DEFAULT_GRAPH_IMPL
from planner.errors import SpecError
from planner.membership import PlanningOptions
from planner.models import ModelSpec, load_model
from planner.search_islands import IslandRequest
from planner.transformer_impl import default_impl

if TYPE_CHECKING:
    from planner.plan import Plan, Training
from megatron_hexi.flag_parsing import Parser, check_split, range_problems
from megatron_hexi.flags import MODEL_FLAGS, build_parser
from megatron_hexi.plan_flags import (
    ACCEPTED,
    iterations,
    plan_flag_problems,
    schedule_problems,
)
from megatron_hexi.refused_flags import REFUSED_DESTS, refused_problems


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line, checked on its own (not against a plan): raises one SpecError that
    lists every problem it has."""
    args, problems = _parse(argv)
    if problems:
        raise SpecError(problems)
    assert args is not None
    return args


def _parse(argv: Sequence[str] | None) -> tuple[argparse.Namespace | None, list[str]]:
    """The parsed flags (None if argparse could not read the line) and all their problems: bad
    values, unknown and refused flags, ranges, and flags that need or exclude each other."""
    parser = build_parser()
    try:
        args, unknown = parser.parse_known_args(argv)
    except SpecError as e:
        return None, list(map(str, e.problems))
    assert isinstance(parser, Parser)
    problems = list(parser.problems)
    for dest in parser.bad:  # reported once: later checks see the flag as not given
        setattr(args, dest, parser.get_default(dest))
    flags = [u for u in unknown if u.startswith("--")]
    if flags:  # the other words are their values
        problems.append(
            f"unsupported flag{'s' if len(flags) > 1 else ''}: {' '.join(flags)} "
            f"(this runtime does not implement {'them' if len(flags) > 1 else 'it'}; "
            f"see pretrain_gpt.py --help and docs/megatron-flags.md)"
        )
    elif unknown:
        problems.append(f"unexpected argument: {' '.join(unknown)}")
    problems += refused_problems(args)
    if args.recompute_activations:
        problems.append(
            "--recompute-activations (selective recompute) is not supported; use "
            "--recompute-granularity full, or plan with recompute"
        )
    if args.recompute_granularity == "selective":
        problems.append(
            "--recompute-granularity selective is not supported; use --recompute-granularity "
            "full with a plan that recomputes, or drop the flag"
        )
    problems += range_problems(args)
    problems += _collect(check_precision, args)
    problems += _collect(check_plan_source, args)
    problems += _collect(check_split, args.split)
    if args.lr is None and "lr" not in parser.bad:
        problems.append("--lr is required (the peak learning rate)")
    if not parser.bad & {"train_iters", "train_samples"}:
        problems += schedule_problems(args)
    if not args.mock_data and not args.data_path:
        problems.append("give --mock-data or --data-path")
    if args.data_path:
        problems += _collect(check_tokenizer_flags, args)
    if args.valid_data_path and not args.data_path:
        problems.append("--valid-data-path needs --data-path (and its tokenizer)")
    if args.save_interval and not args.save:
        problems.append("--save-interval needs --save DIR")
    if args.manual_gc_interval and not args.manual_gc:
        problems.append("--manual-gc-interval needs --manual-gc (Python collects on its own)")
    loading = (
        "ckpt_step",
        "finetune",
        "no_load_optim",
        "no_load_rng",
        "hetero_load_if_exists",
        "exit_on_missing_checkpoint",
    )
    given = [f for f in loading if getattr(args, f) not in (None, False)]
    if not args.load and given:
        problems.append(f"--{given[0].replace('_', '-')} needs --load DIR")
    return args, problems


def _collect(check: Callable[[Any], None], value: Any) -> list[str]:
    """The problems a raising check finds, as a list."""
    try:
        check(value)
    except SpecError as e:
        return list(map(str, e.problems))
    return []


def check_precision(args: argparse.Namespace) -> None:
    """--fp16 or --bf16, not both (as Megatron-LM); the loss-scale flags in range. A constant
    --loss-scale needs 16-bit parameters; the dynamic-scale flags are Megatron-LM's defaults
    unless given, and act under --fp16 only."""
    if args.fp16 and args.bf16:
        raise SpecError("--fp16 and --bf16 exclude each other: give one of them")
    problems = [
        f"--{flag} must be {what}, got {value}"
        for flag, value, bad, what in (
            (
                "loss-scale",
                args.loss_scale,
                args.loss_scale is not None and args.loss_scale <= 0,
                "> 0",
            ),
            ("initial-loss-scale", args.initial_loss_scale, args.initial_loss_scale <= 0, "> 0"),
            ("min-loss-scale", args.min_loss_scale, args.min_loss_scale <= 0, "> 0"),
            (
                "loss-scale-window",
                args.loss_scale_window,
                args.loss_scale_window < 1 or args.loss_scale_window % 1,
                "a whole number >= 1",
            ),
            ("hysteresis", args.hysteresis, args.hysteresis < 1, ">= 1"),
        )
        if bad
    ]
    if not problems and args.fp16 and args.min_loss_scale > args.initial_loss_scale:
        problems.append(
            f"--min-loss-scale {args.min_loss_scale} is above --initial-loss-scale "
            f"{args.initial_loss_scale}"
        )
    if problems:
        raise SpecError(problems)
    if args.loss_scale is not None and not (args.fp16 or args.bf16):
        raise SpecError("--loss-scale needs --fp16 or --bf16 (fp32 training is not scaled)")


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
    islands = [f for f in ISLAND_FLAGS if getattr(args, f, None) != _ISLAND_DEFAULTS.get(f)]
    if islands and not args.hetero_cluster:
        raise SpecError(
            f"--{islands[0].replace('_', '-')} goes with --hetero-cluster (planning at start-up); "
            f"a plan file already says its islands and outer step"
        )


@dataclass(frozen=True)
class PlanningInputs:
    """What a start plans from: read and checked before any process group exists."""

    cluster: ClusterSpec
    model: ModelSpec
    options: PlanningOptions
    islands: IslandRequest = IslandRequest()  # --islands and the --outer-* flags


def planning_inputs(args: argparse.Namespace, cuda: bool) -> PlanningInputs:
    """--hetero-cluster, --hetero-model and Megatron's batch and memory flags, as the options
    `hexi-plan plan` takes. Without --recompute-granularity the planner may choose recompute
    (its `auto`): a run that shrinks to fewer nodes may need it to fit. Without
    --transformer-impl, Transformer Engine where this run can use it (`cuda` and TE installed),
    else the local spec (planner.transformer_impl.default_impl)."""
    seq = args.seq_length
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        raise SpecError(PARAM_GATHER_NEEDS_DISTRIBUTED_OPTIMIZER)
    graphs = cuda_graph_settings(
        argparse.Namespace(
            cuda_graph_impl=args.cuda_graph_impl or PLAN_DEFAULT_GRAPH_IMPL,
            cuda_graph_scope=args.cuda_graph_scope,
        )
    )
    model = load_model(args.hetero_model)
    return PlanningInputs(
        load_cluster(args.hetero_cluster),
        model,
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
        island_request(args, model.num_layers),
    )


def check_tokenizer_flags(args: argparse.Namespace) -> None:
    """--data-path needs a tokenizer, named with the files its type reads."""
    if args.tokenizer_type is None:
        raise SpecError(
            "--data-path needs --tokenizer-type (one of " + ", ".join(TOKENIZER_TYPES) + ")"
        )
    needs = TOKENIZER_FILES[args.tokenizer_type]
    missing = [f for f in needs if getattr(args, f.lstrip("-").replace("-", "_")) in (None, "")]
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


# What islands (planner.islands) do not run with yet.
OUTER_SHARDED_NEEDS_RANK_SET_BUCKETS = (
    "training.outer with use_distributed_optimizer: the outer step shards its state like the "
    "master weights of one gradient bucket per rank set; drop overlap_grad_reduce (re-plan) and "
    "--ddp-bucket-size"
)


def check_against_plan(args: argparse.Namespace, plan: Plan) -> None:
    """Every given flag must agree with the plan; returns nothing, raises SpecError otherwise."""
    problems = plan_problems(args, plan)
    if problems:
        raise SpecError(problems)


def plan_problems(args: argparse.Namespace, plan: Plan) -> list[str]:
    """One line per given flag that contradicts the plan."""
    m = plan.model
    problems = []
    for flag, field in MODEL_FLAGS.items():
        given = getattr(args, flag)
        if given is not None and given != getattr(m, field):
            problems.append(
                f"--{flag.replace('_', '-')} {given} contradicts the plan's model "
                f"{field} {getattr(m, field)}; drop the flag, or plan a model (YAML) with "
                f"{field}: {given}"
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
    if t.outer and t.use_distributed_optimizer and (t.overlap_grad_reduce or args.ddp_bucket_size):
        problems.append(OUTER_SHARDED_NEEDS_RANK_SET_BUCKETS)
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
    same_module = args.use_flash_attn and t.attention_backend == "auto"  # planner.attention
    if backend is not None and backend != t.attention_backend and not same_module:
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
    if wants_recompute and not plan.training.recompute:
        problems.append(
            "--recompute-granularity full contradicts the plan (recompute: false); re-plan "
            "with hexi-plan ... --recompute"
        )
    return problems + plan_flag_problems(args, plan)


@dataclass(frozen=True)
class CommandLine:
    """A command line checked as far as it can be before torch is imported: the flags, the
    plan of --hetero-plan-path (None: planned at start-up) and the RunConfig."""

    args: argparse.Namespace
    config: RunConfig
    plan: Plan | None


def check_command_line(argv: Sequence[str] | None = None) -> CommandLine:
    """Parse, check and (with --hetero-plan-path) compare with the plan; raises one SpecError
    listing every problem found. Imports no torch."""
    from planner.plan import load_plan

    args, problems = _parse(argv)
    if args is None:
        raise SpecError(problems)
    plan = None
    if args.hetero_plan_path and not any(p.startswith("give exactly one of") for p in problems):
        try:
            plan = load_plan(args.hetero_plan_path)
        except SpecError as e:
            problems += map(str, e.problems)
        else:
            problems += plan_problems(args, plan)
    config = None
    if args.lr is not None and not schedule_problems(args):
        try:
            config = run_config(args, plan.global_batch_size if plan else args.global_batch_size)
        except SpecError as e:
            problems += map(str, e.problems)
    if problems:
        raise SpecError(problems)
    assert config is not None
    return CommandLine(args, config, plan)


# The start-up planner's islands flags (planner.cli_islands, as hexi-plan plan's)
ISLAND_FLAGS = (
    "islands",
    "outer_max_comm_share",
    "outer_max_interval",
    "outer_interval",
    "outer_optimizer",
    "outer_lr",
    "outer_momentum",
    "outer_compression",
    "outer_fragments",
)
_ISLAND_DEFAULTS = {  # the others: None
    "islands": IslandRequest().mode,
    "outer_max_comm_share": IslandRequest().max_comm_share,
    "outer_max_interval": IslandRequest().max_interval,
}

# Flags that never reach the runtime as values: the plan decides what they describe (the flags
# are only checked against it, check_against_plan), or they accept Megatron-LM's one supported
# value. Every other flag maps onto a RunConfig field (run_config; tests check both lists).
NOT_IN_RUN_CONFIG = frozenset(
    {
        "hetero_plan_path",  # read into the Plan itself
        "hetero_cluster",  # planned into the Plan at start-up
        "hetero_model",
        *ISLAND_FLAGS,  # planned into the Plan at start-up
        *MODEL_FLAGS,
        "max_position_embeddings",
        "no_position_embedding",
        "use_rotary_position_embeddings",
        "use_rope_scaling",
        "rotary_percent",
        "group_query_attention",
        "swiglu",
        "untie_embeddings_and_output_weights",
        "normalization",
        "position_embedding_type",
        "disable_bias_linear",
        "recompute_activations",
        "recompute_granularity",
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
        *ACCEPTED,  # accepted with no effect (megatron_hexi.plan_flags.ACCEPTED says why)
        *REFUSED_DESTS,  # refused (megatron_hexi.refused_flags)
    }
)


def run_config(args: argparse.Namespace, global_batch_size: int | None = None) -> RunConfig:
    """The parsed flags (parse_args) as a RunConfig: the one place a flag reaches the runtime.
    `global_batch_size` (the plan's) turns samples into iterations."""
    train_iters, decay_iters, warmup_iters = iterations(args, global_batch_size)
    return RunConfig(
        training=TrainingConfig(
            train_iters=train_iters,
            seed=args.seed,
            exit_interval=args.exit_interval,
            exit_duration_in_mins=args.exit_duration_in_mins,
            exit_signal_handler=args.exit_signal_handler,
            check_for_nan_in_loss_and_grad=args.check_for_nan_in_loss_and_grad,
            manual_gc=args.manual_gc,
            manual_gc_interval=args.manual_gc_interval,
            recompute_method=args.recompute_method,
            recompute_num_layers=args.recompute_num_layers,
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
            optimizer=args.optimizer,
            sgd_momentum=args.sgd_momentum,
        ),
        lr_schedule=LRScheduleConfig(
            lr_decay_style=args.lr_decay_style,
            lr_decay_iters=decay_iters,
            lr_warmup_iters=warmup_iters,
            lr_warmup_fraction=args.lr_warmup_fraction,
            lr_warmup_init=args.lr_warmup_init,
        ),
        precision=PrecisionConfig(
            bf16=args.bf16,
            fp16=args.fp16,
            loss_scale=args.loss_scale,
            initial_loss_scale=args.initial_loss_scale,
            min_loss_scale=args.min_loss_scale,
            loss_scale_window=args.loss_scale_window,
            hysteresis=args.hysteresis,
        ),
        dropout=DropoutConfig(
            attention_dropout=args.attention_dropout, hidden_dropout=args.hidden_dropout
        ),
        data=DataConfig(
            mock_data=args.mock_data,
            data_path=None if args.data_path is None else tuple(args.data_path),
            split=args.split,
            data_cache_path=args.data_cache_path,
            mmap_bin_files=args.mmap_bin_files,
            tokenizer_type=args.tokenizer_type,
            tokenizer_model=args.tokenizer_model,
            vocab_file=args.vocab_file,
            merge_file=args.merge_file,
            vocab_size=args.vocab_size,
            tiktoken_pattern=args.tiktoken_pattern,
            tiktoken_num_special_tokens=args.tiktoken_num_special_tokens,
            tokenizer_special_tokens=special_tokens_flag(args),
            legacy_tokenizer=args.legacy_tokenizer,
            valid_data_path=None if args.valid_data_path is None else tuple(args.valid_data_path),
            make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        ),
        checkpoint=CheckpointConfig(
            save=args.save,
            save_interval=args.save_interval,
            load=args.load,
            exit_on_missing_checkpoint=args.exit_on_missing_checkpoint,
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
            log_params_norm=args.log_params_norm,
            log_world_size_to_tensorboard=args.log_world_size_to_tensorboard,
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
