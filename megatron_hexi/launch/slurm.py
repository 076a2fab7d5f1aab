"""`hexi-launch slurm`: an sbatch script that runs a plan on Slurm.

One Slurm component per (partition, gres type, GPUs per node) of the plan: a heterogeneous job
(`#SBATCH hetjob` between components) when there are several, a plain job otherwise. `--gres`
counts per node, and a component holds only nodes that use the same number of GPUs, so every node
is asked for exactly the GPUs its plan ranks use (a 4-GPU node next to 8-GPU nodes of the same type
gets a component of its own, not a request for 8 it cannot meet). One srun step spans every
component and starts, on each node, a small bash function that works out which plan node it is
(component i's k-th Slurm node runs the plan's k-th node of component i), exports HEXI_PLAN_NODE
and execs torchrun with that node's process count. The script is meant to be read and edited:
settings are `VAR=${VAR:-default}` lines the user can override from the environment. Values reach
the shell quoted (common.sh); values for `#SBATCH` lines, which sbatch reads without a shell, are
refused when they could break the line (common.directive_value).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from megatron_hexi.launch.common import (
    LaunchError,
    PlanNode,
    bash_array,
    comment,
    default_gres_type,
    directive_value,
    entry_words,
    lookup,
    plan_nodes,
    resolve_entry,
    sh,
    shell_default,
)

if TYPE_CHECKING:
    from planner.plan import Plan


@dataclass
class Component:
    partition: str | None  # None: the cluster's default partition
    gres_type: str | None  # None: no GPUs requested (CPU plan)
    gpus: int  # GPUs requested on each node: the plan ranks on each of its nodes
    groups: list[str] = field(default_factory=list)
    nodes: list[PlanNode] = field(default_factory=list)  # plan order


def components(
    plan: Plan,
    partitions: Mapping[str, str] | None = None,
    gres_types: Mapping[str, str] | None = None,
) -> list[Component]:
    """Group the plan's nodes into Slurm components; one-line errors for unmapped GPU types.

    Nodes share a component when they share partition, gres type and process count: `--gres` and
    `--cpus-per-task` are per node, so one component can only ask every node for the same.
    partitions / gres_types: {group name | GPU type (lowercase) | '*': value}. A partition given
    in the cluster spec (`partition:` of a node group) is used when no option names one.
    """
    partitions, gres_types = partitions or {}, gres_types or {}
    for mapping, flag in ((partitions, "--partition"), (gres_types, "--gres-type")):
        for value in mapping.values():  # also those that match no node group: a typo shows
            directive_value(value, flag)
    nodes = plan_nodes(plan)
    comps: dict[tuple[str | None, str | None, int], Component] = {}
    part_of: dict[str, str | None] = {}
    for n in nodes:
        if lookup(partitions, n):
            part_of[n.name] = lookup(partitions, n)
        elif n.partition is not None:
            part_of[n.name] = directive_value(n.partition, f"partition of node group {n.group}")
        else:
            part_of[n.name] = None
    any_partition = any(part_of.values())
    several_types = len({n.gpu for n in nodes}) > 1
    missing = []
    for n in nodes:
        part = part_of[n.name]
        if part is None and (any_partition or several_types):
            if n.gpu not in missing:
                missing.append(n.gpu)
            continue
        if lookup(gres_types, n):
            gres = lookup(gres_types, n)
        else:
            gres = default_gres_type(n.gpu)
            if gres is not None:
                gres = directive_value(gres, f"gres type of GPU {n.gpu}")
        c = comps.setdefault((part, gres, n.nproc), Component(part, gres, n.nproc))
        if n.group not in c.groups:
            c.groups.append(n.group)
        c.nodes.append(n)
    if missing:
        raise LaunchError(
            f"no Slurm partition for GPU type(s) {', '.join(missing)}: give "
            f"--partition GPU=PARTITION for each (e.g. --partition {missing[0]}=...) "
            f"or `partition:` in the cluster spec's node group"
        )
    return list(comps.values())


def check_partitions(
    comps: Sequence[Component],
    run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run,
) -> None:
    """Ask sinfo whether each component fits its partition: enough nodes with enough GPUs of its
    type. Components on the same partition and gres type (same GPUs, different counts per node)
    need separate machines: the larger requests take their nodes first, each the smallest node
    that fits, and what is left must fit the smaller ones. Raises LaunchError with one line per
    component that does not fit."""
    listing: dict[str | None, list[tuple[str, str]]] = {}  # partition -> [(host, gres)]
    for c in comps:
        if c.partition in listing:
            continue
        args = ["sinfo", "-h", "-N", "-o", "%N %G"] + (["-p", c.partition] if c.partition else [])
        try:
            r = run(args, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise LaunchError(f"--check-partitions: cannot run sinfo: {e}")
        if r.returncode != 0:
            raise LaunchError(f"--check-partitions: sinfo failed: {r.stderr.strip()}")
        hosts = [line.strip().partition(" ")[::2] for line in r.stdout.splitlines()]
        listing[c.partition] = [(h, g) for h, g in hosts if h]
    taken: dict[tuple[str | None, str | None], set[str]] = {}
    problems: dict[int, str] = {}
    for i in sorted(range(len(comps)), key=lambda k: -comps[k].gpus):
        c = comps[i]
        fits = {}
        for host, gres in listing[c.partition]:
            have = c.gpus if c.gres_type is None else _gpus_of_type(gres, c.gres_type)
            if have >= c.gpus:
                fits[host] = have
        used = taken.setdefault((c.partition, c.gres_type), set())
        free = sorted((h for h in fits if h not in used), key=lambda h: (fits[h], h))
        used.update(free[: len(c.nodes)])
        if len(free) >= len(c.nodes):
            continue
        where = f"partition {c.partition}" if c.partition else "the default partition"
        what = f"gpu:{c.gres_type}:{c.gpus}" if c.gres_type else "nodes"
        line = (
            f"node group {'+'.join(c.groups)} needs {len(c.nodes)} node(s) with {what}; "
            f"{where} has {len(fits)}" + (f" ({', '.join(sorted(fits))})" if fits else "")
        )
        if len(free) < len(fits):
            line += f", {len(fits) - len(free)} of them for the larger component(s) before it"
        problems[i] = line
    if problems:
        raise LaunchError([problems[i] for i in sorted(problems)])


def _gpus_of_type(gres: str, gres_type: str) -> int:
    """GPUs of one type in sinfo's %G field (`gpu:a100:2(S:0),gpu:t4:1`): the largest count."""
    have = 0
    for item in gres.split(","):
        f = item.split("(")[0].split(":")
        if len(f) >= 3 and f[0] == "gpu" and f[1] == gres_type and f[2].isdigit():
            have = max(have, int(f[2]))
    return have


# The per-node part, run by srun on every node (passed as `bash -c "$(declare -f hexi_node) ..."`).
NODE_FUNCTION = r'''hexi_node() {
    # This node's line of HEXI_NODE_TABLE: "slurm-node-id host plan-node node-rank nproc".
    local id=${SLURM_NODEID:?not inside a Slurm step} line host plan_node node_rank nproc
    line=$(awk -v id="$id" '$1 == id' <<<"$HEXI_NODE_TABLE")
    read -r _ host plan_node node_rank nproc <<<"$line"
    if [[ -z "$line" || "$host" != "${SLURMD_NODENAME:-$host}" ]]; then
        # Slurm numbered the step's nodes differently from the node lists: go by host name
        line=$(awk -v h="${SLURMD_NODENAME:-}" '$2 == h' <<<"$HEXI_NODE_TABLE")
        if [[ $(grep -c . <<<"$line") != 1 ]]; then
            echo "hexi: cannot tell which plan node Slurm node ${SLURMD_NODENAME:-?} (node id $id) is" >&2
            exit 1
        fi
        read -r _ host plan_node node_rank nproc <<<"$line"
    fi
    export HEXI_PLAN_NODE=$plan_node
    echo "hexi: Slurm node $host (node id $id) -> plan node $plan_node, torchrun node rank $node_rank, $nproc process(es)"
    # "$@": the entry, --hetero-plan-path and the training arguments, as srun passed them
    exec timeout -k 10 "$HEXI_TIMEOUT_S" "$PYTHON" -m torch.distributed.run \
        --nnodes "$HEXI_NNODES" --node-rank "$node_rank" --nproc-per-node "$nproc" \
        --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" "$@"
}'''  # noqa: E501 - the shell text's own lines


def generate_sbatch(
    plan: Plan,
    plan_path: str,
    training_args: Sequence[str] = (),
    partitions: Mapping[str, str] | None = None,
    gres_types: Mapping[str, str] | None = None,
    account: str | None = None,
    time: str | None = None,
    job_name: str | None = None,
    log: str = "hexi-%j.out",
    container_image: str | None = None,
    python: str | None = None,
    timeout_s: int = 0,
    master_port: int = 29500,
    entry: str | None = None,
    cpus_per_gpu: int = 2,
    exclusive: bool = False,
    comps: Sequence[Component] | None = None,
) -> str:
    """The sbatch script text. `entry`: a script path, '-m module' or '--no-python program';
    default: the installed hexi-train (common.resolve_entry)."""
    comps = comps if comps is not None else components(plan, partitions, gres_types)
    nodes = [n for c in comps for n in c.nodes]
    het = len(comps) > 1
    plan_path = os.path.abspath(plan_path)
    python = python or ("python" if container_image else sys.executable)
    entry = resolve_entry(entry, python)
    if job_name is None:  # from the plan's file name, reduced to characters safe anywhere
        stem = os.path.splitext(os.path.basename(plan_path))[0]
        job_name = "hexi-" + re.sub(r"[^A-Za-z0-9._-]", "_", stem)
    job_name = directive_value(job_name, "--job-name")
    log = directive_value(log, "--log")
    account = account and directive_value(account, "--account")
    time = time and directive_value(time, "--time")

    L = [
        "#!/bin/bash",
        "# Generated by `hexi-launch slurm` (megatron-hexi). Edit freely.",
        f"# Plan: {comment(plan_path)}",
        f"#   {plan.world_size} rank(s) on {len(nodes)} node(s); "
        + (f"heterogeneous job, {len(comps)} components:" if het else "plain job:"),
    ]
    for i, c in enumerate(comps):
        gpu = "/".join(sorted({n.gpu for n in c.nodes}))
        L.append(
            comment(
                f"#   component {i}: node group {'+'.join(c.groups)} ({gpu}), partition "
                f"{c.partition or '(default)'}, plan nodes "
                + " ".join(f"{n.name}[{n.nproc}]" for n in c.nodes)
            )
        )
    L += [
        "# Submit with `sbatch THIS_FILE`; override the settings below from the environment,",
        "# e.g. `MASTER_PORT=29600 HEXI_TIMEOUT_S=3600 sbatch THIS_FILE`.",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --output={log}",
    ]
    for i, c in enumerate(comps):
        if i:
            L.append("#SBATCH hetjob")
        if c.partition:
            L.append(f"#SBATCH --partition={c.partition}")
        if account:
            L.append(f"#SBATCH --account={account}")
        if time:
            L.append(f"#SBATCH --time={time}")
        L += [f"#SBATCH --nodes={len(c.nodes)}", "#SBATCH --ntasks-per-node=1"]
        if c.gres_type:
            L.append(f"#SBATCH --gres=gpu:{c.gres_type}:{c.gpus}")
        if cpus_per_gpu:
            L.append(f"#SBATCH --cpus-per-task={int(cpus_per_gpu) * max(c.gpus, 1)}")
        if exclusive:
            L.append("#SBATCH --exclusive")
    L += [
        "set -euo pipefail",
        "",
        "# ---- settings (each can be overridden from the environment) ----",
        shell_default("PYTHON", python) + "   # python with megatron-hexi and torch",
        shell_default("MASTER_PORT", int(master_port)),
        shell_default("HEXI_TIMEOUT_S", int(timeout_s))
        + "   # torchrun wall limit per node, s (0: none)",
        shell_default("HEXI_PLAN", plan_path),
        ': "${HEXI_MASTER_ADDR:=}"   # empty: first node of component 0',
        "export PYTHON MASTER_PORT HEXI_TIMEOUT_S HEXI_PLAN",
        "",
        "# Training script (absolute), -m module or --no-python program; HEXI_ENTRY in the",
        "# environment replaces it (split at spaces, e.g. HEXI_ENTRY=\"-m my.module\").",
        bash_array("HEXI_ENTRY_WORDS", entry_words(entry)),
        'if [[ -n "${HEXI_ENTRY:-}" ]]; then read -r -a HEXI_ENTRY_WORDS <<<"$HEXI_ENTRY"; fi',
        "",
        "# Training arguments (passed through after --hetero-plan-path):",
        bash_array("TRAINING_ARGS", list(training_args)),
        "",
        "# ---- the plan's nodes per Slurm component, in plan order ----",
        "# component i's k-th Slurm node runs word k of HEXI_PLAN_NODES[i]; a node's",
        "# torchrun node rank is its index in plan order, its process count the plan ranks on it.",
        "HEXI_PLAN_NODES=(",
    ]
    for i, c in enumerate(comps):
        L.append(f"    {sh(' '.join(n.name for n in c.nodes))}   # component {i}")
    L += [
        ")",
        "declare -A HEXI_NODE_RANK=("
        + " ".join(f"[{sh(n.name)}]={n.node_rank}" for n in nodes)
        + ")",
        "declare -A HEXI_NPROC=(" + " ".join(f"[{sh(n.name)}]={n.nproc}" for n in nodes) + ")",
        f"export HEXI_NNODES={len(nodes)}",
        "",
        "# ---- map Slurm's nodes to plan nodes: \"node-id host plan-node node-rank nproc\" ----",
        "HEXI_NODE_TABLE=\"\"",
        "node_id=0",
        "declare -A component_of=()",
        "for ((i = 0; i < ${#HEXI_PLAN_NODES[@]}; i++)); do",
        "    if [[ -n \"${SLURM_HET_SIZE:-}\" ]]; then",
        "        v=SLURM_JOB_NODELIST_HET_GROUP_$i; nodelist=${!v}",
        "    else",
        "        nodelist=$SLURM_JOB_NODELIST",
        "    fi",
        "    mapfile -t hosts < <(scontrol show hostnames \"$nodelist\")",
        "    read -r -a want <<<\"${HEXI_PLAN_NODES[$i]}\"",
        "    if [[ ${#hosts[@]} != \"${#want[@]}\" ]]; then",
        "        echo \"hexi: component $i got ${#hosts[@]} node(s) ($nodelist), "
        "the plan needs ${#want[@]}\" >&2",
        "        exit 1",
        "    fi",
        "    for ((k = 0; k < ${#want[@]}; k++)); do",
        "        p=${want[$k]}",
        "        # components of the same GPU type may share a machine: the plan's nodes may not",
        "        if [[ -n \"${component_of[${hosts[$k]}]:-}\" ]]; then",
        "            echo \"hexi: Slurm gave node ${hosts[$k]} to components "
        "${component_of[${hosts[$k]}]} and $i; each plan node needs a machine of its own: "
        "generate the job with --exclusive\" >&2",
        "            exit 1",
        "        fi",
        "        component_of[${hosts[$k]}]=$i",
        "        HEXI_NODE_TABLE+=\"$node_id ${hosts[$k]} $p "
        "${HEXI_NODE_RANK[$p]} ${HEXI_NPROC[$p]}\"$'\\n'",
        "        if [[ $node_id == 0 ]]; then first_host=${hosts[$k]}; fi",
        "        node_id=$((node_id + 1))",
        "    done",
        "done",
        "export HEXI_NODE_TABLE",
        "export MASTER_ADDR=${HEXI_MASTER_ADDR:-$first_host}",
        "echo \"hexi: job $SLURM_JOB_ID, master $MASTER_ADDR:$MASTER_PORT, nodes:\"",
        "printf '%s' \"$HEXI_NODE_TABLE\" | sed 's/^/hexi:   /'",
        "",
        "# ---- per node: become the plan node, run torchrun ----",
        NODE_FUNCTION,
        "",
    ]
    srun = ["srun"]
    if het:
        srun.append("--het-group=0-$((SLURM_HET_SIZE - 1))")
    srun.append("--kill-on-bad-exit=1")
    if container_image:
        L += [
            shell_default("HEXI_CONTAINER_IMAGE", container_image),
            ': "${HEXI_CONTAINER_MOUNTS:=$PWD:$PWD}"',
            "",
        ]
        srun += [
            '--container-image="$HEXI_CONTAINER_IMAGE"',
            '--container-mounts="$HEXI_CONTAINER_MOUNTS"',
            '--container-workdir="$PWD"',
        ]
    L += [
        " ".join(srun) + " \\",
        '    bash -c "$(declare -f hexi_node); hexi_node \\"\\$@\\"" hexi_node \\',
        '    "${HEXI_ENTRY_WORDS[@]}" --hetero-plan-path "$HEXI_PLAN" "${TRAINING_ARGS[@]}"',
        'echo "hexi: job $SLURM_JOB_ID finished"',
        "",
    ]
    return "\n".join(L)


def summary(path: str, comps: Sequence[Component]) -> str:
    """What `-o` wrote: the job's components, each with its nodes and per-node request, and how
    to submit it (one line per component; names escaped so each stays one line)."""
    kind = f"heterogeneous job, {len(comps)} components" if len(comps) > 1 else "plain job"
    lines = [f"wrote {path}: {kind}"]
    for i, c in enumerate(comps):
        what = f"gpu:{c.gres_type}:{c.gpus}" if c.gres_type else f"{c.gpus} process(es)"
        lines.append(
            f"  component {i}: partition {c.partition or '(default)'}, {len(c.nodes)} node(s) "
            f"with {what} each: plan node(s) {' '.join(n.name for n in c.nodes)}"
        )
    lines.append(f"submit with: sbatch {sh(path)}")
    return "\n".join(comment(line) for line in lines)
