"""hexi-launch: job scripts from a plan.

  hexi-launch slurm PLAN.json [--partition GPU=PARTITION ...] [--gres-type GPU=TYPE ...]
      [--account A] [--time T] [--container-image IMG] [--python PY] [--timeout-s N]
      [--check-partitions] [-o job.sbatch] -- TRAINING_ARGS
  hexi-launch torchrun PLAN.json [--master-addr A] [--master-port P] [-o DIR] -- TRAINING_ARGS
  hexi-launch {slurm,torchrun} --elastic CLUSTER.yaml --model MODEL [--min-nodes K]
      [--max-restarts N] ... -- TRAINING_ARGS   (the workers plan at every start)

Problems with the plan or the options are one line each on stderr, exit code 2.
"""

import argparse
import os
import stat
import sys
from collections.abc import Sequence

from megatron_hexi.launch.common import comment
from planner.cli_args import ArgumentParser, bounded_int, with_examples
from planner.errors import SpecError

# Bounds of the numeric flags, so that no value reaches a script where the tool reading it would
# refuse it at run time or take it for something else. Ports: 1..65535; port 0 asks the OS for
# any free port, which the other nodes could not find. --timeout-s: 0 means no limit (documented),
# a negative number is no time; the upper bound (2**31 - 1 s, 68 years) is one every `timeout` and
# shell takes as a number. --cpus-per-gpu: 0 omits --cpus-per-task (documented), which Slurm
# takes only >= 1; 1024 is far above any machine's CPUs per GPU, so a larger value is a typo.
PORT = bounded_int(1, 65535)
TIMEOUT_S = bounded_int(0, 2**31 - 1)
CPUS_PER_GPU = bounded_int(0, 1024)


AFTER_DASHES = "Arguments after `--` go to the training script."
FROM_CHECKOUT = "Plan paths here are relative to a megatron-hexi checkout."
SLURM_EXAMPLE = (
    "hexi-launch slurm examples/plans/hetero-4rank.json --partition A100-SXM-80GB=a100 "
    "--partition RTX-4090=rtx4090 --partition RTX-3090=rtx3090 -o job.sbatch "
    "-- --mock-data --train-iters 100 --lr 1e-4"
)
TORCHRUN_EXAMPLE = (
    "hexi-launch torchrun examples/plans/hetero-4rank.json -o nodes "
    "-- --mock-data --train-iters 100 --lr 1e-4"
)


ELASTIC_NOTE = (
    "With --elastic the first argument is a cluster YAML: the workers plan at every start for "
    "the nodes that are there (pretrain_gpt.py --hetero-cluster) and resume from the last "
    "checkpoint, so the training arguments need --save DIR --load DIR --hetero-load-if-exists."
)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", help="plan JSON (hexi-plan); with --elastic: cluster YAML")
    p.add_argument(
        "--python",
        help="python on the nodes (default: this interpreter; `python` with --container-image)",
    )
    p.add_argument("--master-port", type=PORT, default=29500, help="1..65535 (default 29500)")
    p.add_argument(
        "--timeout-s",
        type=TIMEOUT_S,
        default=0,
        help="wall limit per node for torchrun, seconds (0: none)",
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--entry",
        help="training script torchrun runs (default: the hexi-train installed beside --python, "
        "by absolute path; hexi-train from the node's PATH for a bare --python name)",
    )
    g.add_argument("--entry-module", help="run a python module instead (torchrun -m)")
    e = p.add_argument_group("elastic jobs (--elastic)")
    e.add_argument(
        "--elastic",
        action="store_true",
        help="survive lost and returning nodes: torch elastic (c10d rendezvous), re-planning at "
        "every start",
    )
    e.add_argument("--model", help="with --elastic: catalog model name or model YAML")
    e.add_argument(
        "--min-nodes",
        type=bounded_int(1, 1 << 20),
        default=None,
        help="fewest nodes to train on (default: the fewest the model fits on, as "
        "`hexi-plan min-nodes` says)",
    )
    e.add_argument(
        "--max-restarts",
        type=bounded_int(0, 1000),
        default=3,
        help="worker-group restarts after failures (default 3; nodes joining do not count)",
    )
    e.add_argument("--rdzv-id", default="hexi", help="rendezvous id (default hexi)")
    e.add_argument(
        "--rdzv-conf",
        default=None,
        help="torchrun --rdzv-conf, e.g. last_call_timeout=10,keep_alive_interval=5",
    )


def _parser() -> ArgumentParser:
    ap = ArgumentParser(
        prog="hexi-launch",
        description=__doc__.split("\n")[0],
        **with_examples(SLURM_EXAMPLE, TORCHRUN_EXAMPLE, note=f"{AFTER_DASHES} {FROM_CHECKOUT}"),
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser(
        "slurm",
        help="write an sbatch script (a heterogeneous job if the plan's nodes differ in "
        "partition, GPU type or GPUs used)",
        **with_examples(
            SLURM_EXAMPLE,
            "sbatch job.sbatch",
            note=f"{AFTER_DASHES} Each plan node becomes one Slurm node with exactly the GPUs its "
            f"plan ranks use. {FROM_CHECKOUT}",
        ),
    )
    _common(s)
    s.add_argument(
        "--partition",
        action="append",
        metavar="GPU=PARTITION",
        help="partition per GPU type or node group (repeatable); a bare PARTITION "
        "applies to all; default: `partition:` from the cluster spec",
    )
    s.add_argument(
        "--gres-type",
        action="append",
        metavar="GPU=TYPE",
        help="Slurm gres type per GPU type (default: derived, A100-SXM-80GB -> a100)",
    )
    s.add_argument("--account")
    s.add_argument("--time", help="Slurm time limit, e.g. 2:00:00")
    s.add_argument("--job-name")
    s.add_argument("--log", default="hexi-%j.out", help="Slurm output file (default hexi-%%j.out)")
    s.add_argument("--container-image", help="run in a container (pyxis --container-image)")
    s.add_argument(
        "--cpus-per-gpu",
        type=CPUS_PER_GPU,
        default=2,
        help="CPUs per requested GPU, for --cpus-per-task (default 2; 0: omit)",
    )
    s.add_argument("--exclusive", action="store_true", help="whole nodes (#SBATCH --exclusive)")
    s.add_argument(
        "--check-partitions",
        action="store_true",
        help="ask sinfo whether each node group fits its partition; exit 2 if not",
    )
    s.add_argument("-o", "--output", help="write the script here (default: stdout)")
    t = sub.add_parser(
        "torchrun",
        help="per-node torchrun commands (no Slurm)",
        **with_examples(
            TORCHRUN_EXAMPLE,
            "hexi-launch torchrun examples/plans/hetero-4rank.json --master-addr 10.0.0.1 "
            "-- --mock-data --train-iters 100 --lr 1e-4",
            note=f"{AFTER_DASHES} With -o, run DIR/<plan node>.sh on each machine, in any "
            f"order. {FROM_CHECKOUT}",
        ),
    )
    _common(t)
    t.add_argument(
        "--master-addr",
        help="address of the first plan node (default: its hostname "
        "in the cluster spec, else $MASTER_ADDR at run time)",
    )
    t.add_argument(
        "-o",
        "--output",
        metavar="DIR",
        help="write one script per node, DIR/<plan node>.sh (default: print commands)",
    )
    return ap


def _write(path: str, text: str, executable: bool = True) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    if executable:
        os.chmod(tmp, os.stat(tmp).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    os.replace(tmp, path)


def run(argv: list[str]) -> int:
    if "--" in argv:
        i = argv.index("--")
        argv, training_args = argv[:i], argv[i + 1 :]
    else:
        training_args = []
    args = _parser().parse_args(argv)
    from megatron_hexi.launch.common import LaunchError, file_in, parse_mapping
    from planner.plan import load_plan

    setup = None
    if args.elastic:
        from megatron_hexi.launch.elastic import elastic_setup

        if not args.model:
            raise LaunchError("--elastic needs --model (a catalog model name or a model YAML)")
        if not os.path.isfile(args.plan):
            raise LaunchError(f"--elastic: {args.plan!r} is not a file (give the cluster YAML)")
        setup = elastic_setup(
            args.plan,
            args.model,
            training_args,
            args.min_nodes,
            args.max_restarts,
            args.rdzv_id,
            args.rdzv_conf,
        )
        plan, training_args = setup.plan, setup.training_args
        print(f"hexi-launch: elastic job, {comment(setup.min_nodes_reason)}", file=sys.stderr)
    else:
        given = [f for f in ("model", "min_nodes", "rdzv_conf") if getattr(args, f) is not None]
        if given:
            raise LaunchError(f"--{given[0].replace('_', '-')} goes with --elastic")
        plan = load_plan(args.plan)
    entry = f"-m {args.entry_module}" if args.entry_module else args.entry
    if args.cmd == "slurm":
        from megatron_hexi.launch import slurm

        partitions = parse_mapping(args.partition, "--partition", True)
        gres_types = parse_mapping(args.gres_type, "--gres-type")
        comps = slurm.components(plan, partitions, gres_types)
        if args.check_partitions:
            slurm.check_partitions(comps)
        text = slurm.generate_sbatch(
            plan,
            args.plan,
            training_args,
            account=args.account,
            time=args.time,
            job_name=args.job_name,
            log=args.log,
            container_image=args.container_image,
            python=args.python,
            timeout_s=args.timeout_s,
            master_port=args.master_port,
            entry=entry,
            cpus_per_gpu=args.cpus_per_gpu,
            exclusive=args.exclusive,
            comps=comps,
            elastic=setup.launch if setup else None,
        )
        if args.output:
            _write(args.output, text)
            print(slurm.summary(args.output, comps))
        else:
            sys.stdout.write(text)
        return 0
    from megatron_hexi.launch import torchrun

    kw = dict(
        training_args=training_args,
        master_addr=args.master_addr,
        master_port=args.master_port,
        python=args.python,
        entry=entry,
        timeout_s=args.timeout_s,
    )
    if setup is not None:
        commands = torchrun.elastic_commands(
            setup,
            master_addr=args.master_addr,
            master_port=args.master_port,
            python=args.python,
            entry=entry,
            timeout_s=args.timeout_s,
        )
        if args.output:
            if os.path.exists(args.output) and not os.path.isdir(args.output):
                raise LaunchError(f"-o {args.output!r}: exists and is not a directory")
            os.makedirs(args.output, exist_ok=True)
            for node, cmd in commands:
                path = file_in(args.output, node.name, ".sh")
                _write(path, torchrun.elastic_script(node, cmd, setup))
                print(comment(f"wrote {path}: run it on node {node.name}"))
            return 0
        for node, cmd in commands:
            host = f" (host {node.hostname})" if node.hostname else ""
            print(comment(f"# on node {node.name}{host}: {node.nproc} process(es)"))
            print(cmd)
        return 0
    if args.output:
        if os.path.exists(args.output) and not os.path.isdir(args.output):
            raise LaunchError(f"-o {args.output!r}: exists and is not a directory")
        scripts = torchrun.node_scripts(plan, args.plan, **kw)  # refuses bad node names
        os.makedirs(args.output, exist_ok=True)
        paths = {}
        for name, text in scripts.items():
            paths[name] = file_in(args.output, name, ".sh")
            _write(paths[name], text)
        print(torchrun.summary(plan, args.output, paths, args.master_addr))
        return 0
    for node, cmd in torchrun.torchrun_commands(plan, args.plan, **kw):
        host = f" (host {node.hostname})" if node.hostname else ""
        print(comment(f"# on plan node {node.name}{host}: {node.nproc} process(es)"))
        print(cmd)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return run(argv)
    except SpecError as e:
        for line in e.problems:  # a name with a line break in it still makes one line
            print(f"hexi-launch: error: {comment(line)}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"hexi-launch: error: {comment(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
