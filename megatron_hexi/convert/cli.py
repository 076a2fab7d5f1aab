"""`hexi-convert`: Hugging Face Llama, Mistral and Qwen2 models <-> megatron-hexi checkpoints.

    hexi-convert import --hf-dir DIR --output CKPT [--seq-length N]
    hexi-convert export --load CKPT --output DIR [--ckpt-step N] [--dtype bfloat16]
    hexi-convert import-megatron --load MDIR [--ckpt-step N] --output CKPT
    hexi-convert export-megatron --load CKPT --output MDIR
    hexi-convert verify --hf-dir DIR --load CKPT --hetero-plan-path PLAN [--hetero-device cpu]

Every problem is one line on stderr, `hexi-convert: error: ...`, exit 2.
"""

from __future__ import annotations

import argparse
import sys

from megatron_hexi.convert.verify import DEFAULT_MAX_TOKENS

IMPORT_EXAMPLE = """\
  # HF -> ours: a params-only checkpoint in ckpt/ (--load ckpt/) and ckpt/model.yaml
  {prog} import --hf-dir Llama-2-7b-hf/ --output ckpt/ --seq-length 4096
  hexi-plan plan --cluster examples/clusters/mixed-lab.yaml --model ckpt/model.yaml \\
      --global-batch-size 64 --output plan.json
"""

EXPORT_EXAMPLE = """\
  # ours -> HF: the save ckpt/ points to (its latest), cast to bf16
  {prog} export --load ckpt/ --output hf/ --dtype bfloat16
  # a given iteration of a training run's save, as stored (fp32 master weights), with the
  # tokenizer of the model it started from
  {prog} export --load save/ --ckpt-step 2000 --output hf-2000/ --tokenizer-dir Llama-2-7b-hf/
"""

MEGATRON_EXAMPLE = """\
  # a Megatron-LM save (its latest iteration) -> ours, and back
  {prog} import-megatron --load megatron-save/ --output ckpt/
  {prog} export-megatron --load ckpt/ --output megatron-out/
"""

VERIFY_EXAMPLE = """\
  # the checkpoint under the plan's shards and stages, against transformers, on this machine
  {prog} verify --hf-dir Llama-2-7b-hf/ --load ckpt/ --hetero-plan-path plan.json
"""

OVERWRITE_HELP = (
    "replace a non-empty --output folder whole (default: refuse it); its old files are removed "
    "only once the new ones are complete"
)


def _command(
    sub: argparse._SubParsersAction, name: str, help: str, epilog: str
) -> argparse.ArgumentParser:
    """A subcommand whose --help ends with its runnable examples (`epilog`)."""
    return sub.add_parser(
        name, help=help, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def _parser(prog: str) -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(
        prog=prog,
        description="Convert between Hugging Face Llama, Mistral and Qwen2 models and "
        "megatron-hexi checkpoints.",
        epilog=f"examples:\n{IMPORT_EXAMPLE}{EXPORT_EXAMPLE}{MEGATRON_EXAMPLE}{VERIFY_EXAMPLE}".format(
            prog=prog
        ),
        formatter_class=raw,
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    i = _command(
        sub,
        "import",
        "HF LlamaForCausalLM, MistralForCausalLM or Qwen2ForCausalLM -> checkpoint",
        f"example:\n{IMPORT_EXAMPLE.format(prog=prog)}",
    )
    i.add_argument("--hf-dir", required=True, help="the HF model folder (config.json, weights)")
    i.add_argument("--output", required=True, help="checkpoint directory (use as --load)")
    i.add_argument(
        "--seq-length",
        type=int,
        default=None,
        help="training sequence length for the model YAML (default: max_position_embeddings)",
    )
    i.add_argument("--model-yaml", default=None, help="default: OUTPUT/model.yaml")
    i.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    e = _command(
        sub,
        "export",
        "checkpoint -> HF model of the family it came from (Llama when unknown)",
        f"examples:\n{EXPORT_EXAMPLE.format(prog=prog)}",
    )
    e.add_argument("--load", required=True, help="a checkpoint folder (import or training save)")
    e.add_argument("--ckpt-step", type=int, default=None, help="default: the latest")
    e.add_argument("--output", required=True, help="the HF folder to write")
    e.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="default: as stored (fp32 master weights for a trained checkpoint)",
    )
    e.add_argument(
        "--tokenizer-dir",
        default=None,
        help="take the tokenizer and generation files from this HF folder (default: those the "
        "import kept in LOAD/hf_files, if any)",
    )
    e.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    im = _command(
        sub,
        "import-megatron",
        "Megatron-LM GPT save (torch_dist, or legacy torch at TP = PP = 1) -> checkpoint",
        f"example:\n{MEGATRON_EXAMPLE.format(prog=prog)}",
    )
    im.add_argument("--load", required=True, help="the Megatron-LM --save folder")
    im.add_argument("--ckpt-step", type=int, default=None, help="default: its latest")
    im.add_argument("--output", required=True, help="checkpoint directory (use as --load)")
    im.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    em = _command(
        sub,
        "export-megatron",
        "checkpoint -> Megatron-LM torch_dist save (loads under any TP/PP)",
        f"example:\n{MEGATRON_EXAMPLE.format(prog=prog)}",
    )
    em.add_argument("--load", required=True, help="a checkpoint folder (import or training save)")
    em.add_argument("--ckpt-step", type=int, default=None, help="default: the latest")
    em.add_argument("--output", required=True, help="the Megatron-LM folder to write")
    em.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    v = _command(
        sub,
        "verify",
        "the runtime's logits under a plan against transformers' (exit 1 above 1e-5)",
        f"example:\n{VERIFY_EXAMPLE.format(prog=prog)}",
    )
    v.add_argument("--hf-dir", required=True, help="the HF model folder that was imported")
    v.add_argument("--load", required=True, help="the checkpoint to check")
    v.add_argument("--hetero-plan-path", required=True, help="the plan whose layout to check")
    v.add_argument(
        "--hetero-device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where the plan's ranks run, all on this machine (default: cpu)",
    )
    v.add_argument(
        "--seq-length",
        type=int,
        default=None,
        help=f"tokens per sample (default: the model's, at most {DEFAULT_MAX_TOKENS}); every "
        "pipeline runs one sample",
    )
    v.add_argument("--seed", type=int, default=0, help="of the random tokens (default: 0)")
    v.add_argument(
        "--timeout", type=float, default=600.0, help="seconds the ranks may take (default: 600)"
    )
    return p


def main(argv: list[str] | None = None, prog: str = "hexi-convert") -> int:
    import torch

    from megatron_hexi.convert.hf import export_hf, head_dim_warning, import_hf
    from megatron_hexi.convert.verify import TOLERANCE, verify
    from planner.errors import SpecError
    from planner.layout import canonical_shards

    args = _parser(prog).parse_args(argv)
    try:
        if args.cmd == "import":
            model, final, yml = import_hf(
                args.hf_dir, args.output, args.seq_length, args.model_yaml, args.overwrite
            )
            count = sum(_numel(s.shape) for s in canonical_shards(model))
            print(f"imported {args.hf_dir} ({count} parameters) -> {final}; model spec: {yml}")
        elif args.cmd == "import-megatron":
            from megatron_hexi.convert.megatron import import_megatron

            model, final, yml = import_megatron(
                args.load, args.output, args.ckpt_step, args.overwrite
            )
            count = sum(_numel(s.shape) for s in canonical_shards(model))
            print(f"imported {args.load} ({count} parameters) -> {final}; model spec: {yml}")
        elif args.cmd == "export-megatron":
            from megatron_hexi.convert.megatron import export_megatron

            model, folder = export_megatron(args.load, args.output, args.ckpt_step, args.overwrite)
            print(f"exported {args.load} -> {folder} (torch_dist)")
        elif args.cmd == "verify":
            error = verify(
                args.hf_dir,
                args.load,
                args.hetero_plan_path,
                args.hetero_device,
                args.seq_length,
                args.seed,
                args.timeout,
            )
            print(f"max relative logit error: {error:.3e}")
            if not error <= TOLERANCE:
                print(
                    f"{prog}: error: above {TOLERANCE:g}: the conversion or the plan's layout "
                    "changes what the model computes",
                    file=sys.stderr,
                )
                return 1
        else:
            model, out, carried = export_hf(
                args.load,
                args.output,
                args.ckpt_step,
                getattr(torch, args.dtype) if args.dtype else None,
                args.overwrite,
                args.tokenizer_dir,
            )
            files = ", ".join(["model.safetensors", "config.json", *carried])
            print(f"exported {args.load} -> {out}: {files}")
            if not any(n.startswith("tokenizer") for n in carried):
                print(
                    f"{prog}: warning: no tokenizer files written (give --tokenizer-dir)",
                    file=sys.stderr,
                )
            warning = head_dim_warning(model)
            if warning:
                print(f"{prog}: warning: {warning}", file=sys.stderr)
    except SpecError as err:
        for line in err.problems:
            print(f"{prog}: error: {line}", file=sys.stderr)
        return 2
    except OSError as err:  # the output's disk full or gone mid-write, say
        where = err.filename or args.output
        print(f"{prog}: error: {where}: {err.strerror}", file=sys.stderr)
        return 2
    return 0


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def cli() -> None:
    sys.exit(main())


if __name__ == "__main__":
    cli()
