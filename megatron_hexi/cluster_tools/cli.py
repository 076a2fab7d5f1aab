"""hexi-cluster: describe the machines for the planner's cluster spec.

  hexi-cluster detect [-o FILE] [--name NAME] [--allow-cpu [--cpu-ranks N]]
      this node's `nodes:` entry (YAML) from torch.cuda / nvidia-smi
  hexi-cluster bench [-o links.yaml] [--sizes 8B 1MB 64MB] [--iters N] [--timeout-s S] ...
      run under torchrun (or a hexi-launch script): measured `links:` between all node pairs

Problems are one line on stderr, exit code 2.

examples:
  hexi-cluster detect -o node.yaml
  hexi-cluster detect --allow-cpu --cpu-ranks 2
  torchrun --nproc-per-node 2 --no-python hexi-cluster bench --sizes 8B 1MB --iters 3 \\
      -o links.yaml
"""

import argparse
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from planner.cli_args import with_examples
from planner.errors import SpecError


def detect_parser() -> argparse.ArgumentParser:
    """`hexi-cluster detect`'s arguments (its own function, so tests can parse its examples)."""
    ap = argparse.ArgumentParser(
        prog="hexi-cluster detect",
        description="this node's cluster-spec entry (one `nodes:` item)",
        **with_examples(
            "hexi-cluster detect -o node.yaml",
            "hexi-cluster detect --name rtx4090-0 --allow-cpu --cpu-ranks 2",
            note="Paste the entry under `nodes:` of the cluster file; set `count:` for "
            "identical machines.",
        ),
    )
    ap.add_argument("-o", "--output", help="write the YAML snippet here (default: stdout)")
    ap.add_argument("--name", help="node name in the spec (default: short host name)")
    ap.add_argument(
        "--allow-cpu",
        action="store_true",
        help="without GPUs, write a CPU entry instead of failing",
    )
    ap.add_argument(
        "--cpu-ranks",
        type=int,
        default=1,
        help="with --allow-cpu: CPU processes (emulated GPUs) for this node",
    )
    return ap


def _detect(argv: list[str]) -> int:
    args = detect_parser().parse_args(argv)
    from megatron_hexi.cluster_tools.detect import detect, to_yaml

    entry, notes = detect(allow_cpu=args.allow_cpu, name=args.name, cpu_ranks=args.cpu_ranks)
    text = to_yaml(entry, notes)
    if args.output:
        tmp = f"{args.output}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, args.output)
        print(
            f"hexi-cluster: wrote {args.output} ({entry['gpus_per_node']} x {entry['gpu']})",
            file=sys.stderr,
        )
    else:
        sys.stdout.write(text)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in ("detect", "bench"):
        print(__doc__, file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    try:
        if argv[0] == "detect":
            return _detect(argv[1:])
        from megatron_hexi.cluster_tools import bench

        return bench.main(argv[1:])
    except SpecError as e:
        for line in e.problems:
            print(f"hexi-cluster: error: {line}", file=sys.stderr)
        return 2


def cli() -> NoReturn:
    """The hexi-cluster command: main, then a deliberate exit (it may have used torch.distributed;
    megatron_hexi.process_exit says why)."""
    from megatron_hexi.process_exit import exit_process

    exit_process(main())


if __name__ == "__main__":
    cli()
