"""The flags pretrain_gpt.py accepts: Megatron-LM's names, one argument group per concern (a
function each: add a flag to its group's function), plus the --hetero-* group and the refused
flags (megatron_hexi.refused_flags). How they are read is megatron_hexi.flag_parsing's;
megatron_hexi.arguments checks them together and against the plan; docs/megatron-flags.md is
generated from this parser (megatron_hexi.flag_docs).
"""

from __future__ import annotations

import argparse

from megatron_hexi.flag_parsing import HelpFormatter, Parser, finite_float
from megatron_hexi.refused_flags import add_refused
from megatron_hexi.run_flags import add_run_flags
from megatron_hexi.tokenizer import TOKENIZER_TYPES
from planner.attention import ATTENTION_BACKENDS
from planner.cli_islands import add_island_flags
from planner.cuda_graphs import CUDA_GRAPH_IMPLS, CUDA_GRAPH_SCOPES
from planner.transformer_impl import TRANSFORMER_IMPLS

# Megatron flag -> plan model field, for the contradiction check.
MODEL_FLAGS = {
    "num_layers": "num_layers",
    "hidden_size": "hidden_size",
    "ffn_hidden_size": "ffn_hidden_size",
    "num_attention_heads": "num_attention_heads",
    "num_query_groups": "num_query_groups",
    "seq_length": "seq_length",
    "kv_channels": "head_dim",
    "norm_epsilon": "norm_epsilon",
    "rotary_base": "rotary_base",
    "init_method_std": "init_method_std",
    "rope_scaling_factor": "rope_scaling_factor",
}
FLOAT_MODEL_FLAGS = frozenset({"norm_epsilon", "init_method_std", "rope_scaling_factor"})


EXAMPLE = """example:
  # plan 4 GPUs of 3 kinds, then train on 4 CPU processes standing in for them
  hexi-plan plan --cluster examples/clusters/mini-hetero.yaml --model tiny \\
      --global-batch-size 8 -o plan.json
  OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 pretrain_gpt.py --hetero-plan-path plan.json \\
      --mock-data --train-iters 20 --lr 1e-3 --lr-decay-style constant \\
      --eval-interval 10 --eval-iters 2 --log-interval 5
"""

PLAN = "default: the plan's"


def build_parser() -> argparse.ArgumentParser:
    """The flags, one argument group per concern; docs/megatron-flags.md lists them."""
    p = Parser(
        prog="pretrain_gpt.py",
        usage="pretrain_gpt.py (--hetero-plan-path PLAN | --hetero-cluster CLUSTER ...) "
        "(--mock-data | --data-path ...) (--train-iters N | --train-samples N) --lr LR [flag ...]",
        allow_abbrev=False,
        description="Train a GPT under a heterogeneous plan. Megatron-LM's flags: a model, "
        "batch or parallelism flag is checked against the plan; a flag this runtime does not "
        "take is refused with what to use instead (all problems of a command line in one "
        "message).",
        formatter_class=HelpFormatter,
        epilog=EXAMPLE,
    )
    _hetero(p)
    _model(p)
    _parallel(p)
    _batch_and_schedule(p)
    _optimizer(p)
    _fusions(p)
    _data(p)
    add_run_flags(p)
    add_refused(p)
    return p


def _hetero(p: argparse.ArgumentParser) -> None:
    h = p.add_argument_group("hetero")
    h.add_argument(
        "--hetero-plan-path",
        default=None,
        help="plan JSON (hexi-plan); or plan at start-up with --hetero-cluster (default: none)",
    )
    h.add_argument(
        "--hetero-cluster",
        default=None,
        help="cluster YAML: plan at every start for the nodes that run processes (elastic "
        "runs); the batch and memory flags are the planning options (default: none)",
    )
    h.add_argument(
        "--hetero-model",
        default=None,
        help="with --hetero-cluster: catalog model name or model YAML, as in hexi-plan "
        "(default: none)",
    )
    add_island_flags(h, "with --hetero-cluster (planned at every start, as by hexi-plan plan): ")
    h.add_argument(
        "--hetero-metrics-path", default=None, help="JSONL metrics per iteration (default: none)"
    )
    h.add_argument(
        "--hetero-device",
        choices=["cpu", "cuda"],
        default=None,
        help="default: cuda when available, else cpu (GPUs emulated by processes)",
    )


def _model(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model (optional: taken from the plan, checked against it)")
    for flag, field in MODEL_FLAGS.items():
        kind = finite_float if flag in FLOAT_MODEL_FLAGS else int
        m.add_argument(
            "--" + flag.replace("_", "-"),
            type=kind,
            default=None,
            help=f"must equal the plan's model {field} ({PLAN})",
        )
    m.add_argument(
        "--max-position-embeddings",
        type=int,
        default=None,
        help="at least the sequence length; with learned_absolute positions it must equal the "
        f"model's position rows, with rope it has no effect ({PLAN})",
    )
    m.add_argument(
        "--use-rope-scaling",
        action="store_true",
        default=None,
        help=f"Llama 3.x's rotary frequency scaling: must match the plan's model ({PLAN})",
    )
    m.add_argument(
        "--rotary-percent",
        type=finite_float,
        default=None,
        help="must be 1.0: the plan's models rotate the whole head (default: 1.0)",
    )
    m.add_argument(
        "--use-rotary-position-embeddings",
        action="store_true",
        default=None,
        help="Megatron-LM's older name of --position-embedding-type rope: the plan's model must "
        "have rotary positions (default: the plan's)",
    )
    m.add_argument(
        "--no-position-embedding",
        action="store_true",
        default=None,
        help="no learned absolute position table: the plan's model must not have one "
        "(rope or none; default: the plan's)",
    )
    m.add_argument(
        "--group-query-attention",
        action="store_true",
        help="grouped-query attention: with --num-query-groups that many groups, alone one "
        "group (Megatron-LM's --num-query-groups default); must match the plan",
    )
    m.add_argument(
        "--swiglu", action="store_true", default=None, help=f"must match the plan's model ({PLAN})"
    )
    m.add_argument(
        "--untie-embeddings-and-output-weights",
        action="store_true",
        default=None,
        help=f"must match the plan's model ({PLAN})",
    )
    m.add_argument(
        "--normalization",
        choices=["RMSNorm", "LayerNorm"],
        default=None,
        help=f"must match the plan's model ({PLAN})",
    )
    m.add_argument(
        "--position-embedding-type",
        choices=["rope", "learned_absolute"],
        default=None,
        help=f"must match the plan's model ({PLAN})",
    )
    m.add_argument(
        "--disable-bias-linear",
        action="store_true",
        default=None,
        help=f"must match the plan's model (no biases; {PLAN})",
    )
    m.add_argument(
        "--use-mcore-models",
        action="store_true",
        help="accepted: the model is always megatron-core's GPTModel",
    )
    m.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        default=None,
        help="the plan's training.attention_backend: auto, flash and fused run torch's fused "
        "attention (no s x s tensor), unfused and local megatron-core's DotProductAttention "
        f"({PLAN})",
    )
    m.add_argument(
        "--use-flash-attn",
        action="store_true",
        default=None,
        help="fused attention: accepted under a plan whose backend is flash or auto (the "
        "same module runs)",
    )
    m.add_argument(
        "--transformer-impl",
        choices=TRANSFORMER_IMPLS,
        default=None,
        help="the plan's training.transformer_impl: transformer_engine (CUDA and Transformer "
        f"Engine) or local (megatron-core's torch layers; {PLAN})",
    )
    m.add_argument(
        "--cuda-graph-impl",
        choices=CUDA_GRAPH_IMPLS,
        default=None,
        help="the plan's training.cuda_graph_impl (CUDA only): local (megatron-core's "
        f"per-layer CudaGraphManager), transformer_engine (TE's graphs) or none ({PLAN})",
    )
    m.add_argument(
        "--cuda-graph-scope",
        nargs="+",
        choices=CUDA_GRAPH_SCOPES,
        default=None,
        help="the plan's training.cuda_graph_scope: the parts of each layer the graphs capture "
        "(default: the plan's, the whole layer)",
    )
    m.add_argument(
        "--attention-dropout", type=finite_float, default=0.1, help="attention dropout rate"
    )
    m.add_argument(
        "--hidden-dropout", type=finite_float, default=0.1, help="dropout rate of each output"
    )
    m.add_argument(
        "--recompute-activations",
        action="store_true",
        help="refused: selective recompute is not implemented; use --recompute-granularity "
        "full with a plan that recomputes",
    )
    m.add_argument(
        "--recompute-granularity",
        choices=["full", "selective"],
        default=None,
        help=f"full: the plan must recompute (training.recompute); selective is refused ({PLAN})",
    )
    m.add_argument(
        "--recompute-method",
        choices=["uniform", "block"],
        default=None,
        help="megatron-core's: uniform recomputes chunks of --recompute-num-layers layers, block "
        "the first N layers of each stage; the plan (recompute: true) counts one layer "
        "recomputed at a time and every layer recomputed: uniform 1, or block N >= each "
        "stage's layers (default: uniform 1 when the plan recomputes)",
    )
    m.add_argument(
        "--recompute-num-layers",
        type=int,
        default=None,
        help="N of --recompute-method (default: 1 when the plan recomputes)",
    )


def _parallel(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism (checked against the plan)")
    g.add_argument(
        "--tensor-model-parallel-size",
        type=int,
        default=None,
        help=f"must be every stage's TP degree ({PLAN})",
    )
    g.add_argument(
        "--pipeline-model-parallel-size",
        type=int,
        default=None,
        help=f"must be every pipeline's stage count ({PLAN})",
    )
    g.add_argument(
        "--sequence-parallel",
        action="store_true",
        default=None,
        help="the plan's training.sequence_parallel: megatron-core's sequence parallelism in "
        f"every stage with TP > 1 ({PLAN})",
    )
    g.add_argument(
        "--use-distributed-optimizer",
        action="store_true",
        default=None,
        help=f"shard fp32 master weights and Adam state (the plan must assume it; {PLAN})",
    )
    g.add_argument(
        "--hetero-optimizer-shard",
        choices=["even", "memory"],
        default=None,
        help=f"how optimizer state is cut over a segment's ranks ({PLAN})",
    )
    g.add_argument(
        "--overlap-grad-reduce",
        action="store_true",
        default=None,
        help="start each gradient bucket's collective during the last backward pass "
        f"(the plan must assume it; {PLAN})",
    )
    g.add_argument(
        "--overlap-param-gather",
        action="store_true",
        default=None,
        help="distributed optimizer: all-gather updated parameters during the next forward "
        f"(the plan must assume it; {PLAN})",
    )
    g.add_argument(
        "--ddp-bucket-size",
        type=int,
        default=None,
        metavar="ELEMENTS",
        help="most gradient elements per bucket (default: 40,000,000, Megatron-LM's floor, "
        "with --overlap-grad-reduce; else one bucket per rank set)",
    )


def _batch_and_schedule(p: argparse.ArgumentParser) -> None:
    b = p.add_argument_group(
        "batch and learning-rate schedule (samples are converted to iterations of the plan's "
        "global batch, as Megatron-LM does without batch ramp-up)"
    )
    b.add_argument(
        "--micro-batch-size",
        type=int,
        default=None,
        help=f"must be every pipeline's micro-batch size ({PLAN})",
    )
    b.add_argument(
        "--global-batch-size", type=int, default=None, help=f"must be the plan's ({PLAN})"
    )
    b.add_argument(
        "--train-iters",
        type=int,
        default=None,
        help="iterations to train (give it or --train-samples; default: none)",
    )
    b.add_argument(
        "--train-samples",
        type=int,
        default=None,
        help="samples to train: train iterations = samples / global batch, which must divide "
        "them (default: none)",
    )
    b.add_argument(
        "--lr", type=finite_float, default=None, help="peak learning rate (required; no default)"
    )
    b.add_argument("--min-lr", type=finite_float, default=0.0, help="floor of the decayed lr")
    b.add_argument(
        "--lr-decay-style",
        choices=["constant", "linear", "cosine", "inverse-square-root"],
        default="linear",
        help="how the lr decays after warm-up",
    )
    b.add_argument(
        "--lr-decay-iters",
        type=int,
        default=None,
        help="iterations of decay (default: --train-iters)",
    )
    b.add_argument(
        "--lr-decay-samples",
        type=int,
        default=None,
        help="samples of decay, with --train-samples (default: --train-samples)",
    )
    b.add_argument("--lr-warmup-iters", type=int, default=0, help="iterations of linear warm-up")
    b.add_argument(
        "--lr-warmup-samples", type=int, default=0, help="samples of warm-up, with --train-samples"
    )
    b.add_argument(
        "--lr-warmup-fraction",
        type=finite_float,
        default=None,
        help="warm-up as a fraction of the decay iterations (default: none; "
        "--lr-warmup-iters or --lr-warmup-samples)",
    )
    b.add_argument(
        "--lr-warmup-init", type=finite_float, default=0.0, help="lr at the start of warm-up"
    )
    b.add_argument("--seed", type=int, default=1234, help="seeds weights, dropout and data order")


def _optimizer(p: argparse.ArgumentParser) -> None:
    o = p.add_argument_group("optimizer and precision")
    o.add_argument(
        "--optimizer",
        choices=["adam", "sgd"],
        default="adam",
        help="Adam(W), or SGD with momentum (torch.optim.SGD, L2 weight decay)",
    )
    o.add_argument(
        "--sgd-momentum", type=finite_float, default=0.9, help="SGD's momentum (--optimizer sgd)"
    )
    o.add_argument("--weight-decay", type=finite_float, default=0.01, help="decoupled decay")
    o.add_argument("--adam-beta1", type=finite_float, default=0.9, help="Adam's beta1")
    o.add_argument("--adam-beta2", type=finite_float, default=0.999, help="Adam's beta2")
    o.add_argument("--adam-eps", type=finite_float, default=1e-8, help="Adam's epsilon")
    o.add_argument(
        "--clip-grad", type=finite_float, default=1.0, help="global gradient-norm clip; 0: none"
    )
    o.add_argument(
        "--bf16", action="store_true", help="bf16 parameters, fp32 gradients and master weights"
    )
    # fp16 with megatron-core's loss scaling: Megatron-LM's flags and defaults (checked in
    # megatron_hexi.arguments.check_precision)
    o.add_argument(
        "--fp16", action="store_true", help="fp16 parameters with loss scaling (GPUs without bf16)"
    )
    o.add_argument(
        "--loss-scale",
        type=finite_float,
        default=None,
        help="constant loss scale (default: dynamic under --fp16)",
    )
    o.add_argument(
        "--initial-loss-scale",
        type=finite_float,
        default=2.0**32,
        help="the dynamic loss scale's start",
    )
    o.add_argument(
        "--min-loss-scale", type=finite_float, default=1.0, help="the dynamic scale's floor"
    )
    o.add_argument(
        "--loss-scale-window",
        type=finite_float,
        default=1000,
        help="steps without inf/NaN before the dynamic scale doubles",
    )
    o.add_argument(
        "--hysteresis",
        type=int,
        default=2,
        help="steps with inf/NaN before the dynamic scale halves",
    )
    o.add_argument(
        "--use-cpu-initialization",
        action="store_true",
        help="accepted: every rank fills its parameters with its slices of the seed's canonical "
        "tensors, the same weights wherever they are computed",
    )
    o.add_argument(
        "--accumulate-allreduce-grads-in-fp32",
        action="store_true",
        help="accepted: gradients are always accumulated and reduced in fp32",
    )
    o.add_argument(
        "--calculate-per-token-loss",
        action="store_true",
        help="accepted: the loss is always weighed per token over the global batch",
    )
    o.add_argument(
        "--attention-softmax-in-fp32",
        action="store_true",
        help="accepted: the fused attention computes its softmax in fp32; megatron-core's "
        "unfused one under bf16 as Megatron-LM's default",
    )


def _fusions(p: argparse.ArgumentParser) -> None:
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
    for flag, dest, what in (
        ("--no-bias-dropout-fusion", "bias_dropout_fusion", "bias-dropout-add"),
        ("--no-rope-fusion", "apply_rope_fusion", "rotary embedding"),
        ("--no-masked-softmax-fusion", "masked_softmax_fusion", "scaled masked softmax"),
        (
            "--no-gradient-accumulation-fusion",
            "gradient_accumulation_fusion",
            "weight-gradient accumulation",
        ),
    ):
        f.add_argument(flag, action="store_false", dest=dest, help=f"unfused {what}")
    f.add_argument(
        "--no-persist-layer-norm",
        action="store_true",
        help="accepted: the persistent layer-norm kernel is Apex's, which does not run here",
    )
    f.add_argument(
        "--cross-entropy-loss-fusion",
        action="store_true",
        help="megatron-core's fused cross-entropy (bf16 runs; off by default, as in Megatron-LM)",
    )


def _data(p: argparse.ArgumentParser) -> None:
    d = p.add_argument_group("data")
    d.add_argument(
        "--mock-data", action="store_true", help="megatron-core's mock dataset (no files)"
    )
    d.add_argument(
        "--data-path",
        nargs="+",
        default=None,
        help="[WEIGHT] PREFIX ... of .bin/.idx pairs (default: none)",
    )
    d.add_argument("--split", default="969,30,1", help="train, validation, test weights")
    d.add_argument(
        "--data-cache-path",
        default=None,
        help="where megatron-core caches sample indices (default: next to the data)",
    )
    d.add_argument(
        "--no-mmap-bin-files",
        action="store_false",
        dest="mmap_bin_files",
        help="read each .bin's samples with file reads, not a memory map (the same tokens; "
        "megatron-core's IndexedDataset) (default: memory-mapped)",
    )
    d.add_argument(
        "--tokenizer-type",
        choices=TOKENIZER_TYPES,
        default=None,
        help="how --data-path was tokenized (Megatron-LM's names; default: none)",
    )
    d.add_argument(
        "--tokenizer-model",
        default=None,
        help="HuggingFaceTokenizer: a tokenizer.json or a model directory; "
        "SentencePieceTokenizer, Llama2Tokenizer: a tokenizer.model; TikTokenizer: its vocab.json "
        "(default: none)",
    )
    d.add_argument(
        "--vocab-file", default=None, help="GPT2BPETokenizer: vocab.json (default: none)"
    )
    d.add_argument(
        "--merge-file", default=None, help="GPT2BPETokenizer: merges.txt (default: none)"
    )
    from megatron_hexi.tokenizer import add_tokenizer_options

    add_tokenizer_options(d)
    d.add_argument(
        "--no-create-attention-mask-in-dataloader",
        action="store_true",
        help="accepted: the data never builds an attention mask (the attention is causal)",
    )
    d.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=None,
        help="the tokenizer's vocabulary padded to a multiple of this x the TP degree (the "
        "least common multiple of the plan's) must be the plan's model vocab_size (default: "
        "not checked; the tokenizer must fit the model's vocab_size)",
    )
