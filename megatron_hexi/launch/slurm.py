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

Elastic jobs (`hexi-launch slurm --elastic CLUSTER.yaml`): the same components and node mapping
(from a plan of the whole cluster), but every node runs torchrun elastically (`--nnodes MIN:MAX`,
c10d rendezvous at the first node, no node ranks) and the workers plan at every start for the
nodes that are there (`--hetero-cluster CLUSTER --hetero-model MODEL`). The rendezvous store lives
in the first node's agent: that node must stay up. A node that fails does not end the job (srun
`--no-kill --kill-on-bad-exit=0`, `#SBATCH --no-kill`): the surviving agents re-rendezvous within
seconds and their workers re-plan and resume from the last checkpoint. Requeueing was rejected:
it restarts the whole job from the queue and drops the surviving agents. Each node's task reports
how its torchrun ended; the job exits 0 when the training finished on some node (its torchrun
exited 0), naming the nodes that failed or were lost, and with srun's status otherwise.
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
    from megatron_hexi.launch.elastic import ElasticLaunch
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


# The per-node part of an elastic job: the same lookup, then torchrun with a c10d rendezvous; it
# does not exec torchrun, so that it can say how torchrun ended (the batch script reads that).
ELASTIC_NODE_FUNCTION = r'''hexi_node() {
    # This node's line of HEXI_NODE_TABLE: "slurm-node-id host plan-node nproc".
    local id=${SLURM_NODEID:?not inside a Slurm step} line node_id host plan_node nproc conf rc=0
    line=$(awk -v id="$id" '$1 == id' <<<"$HEXI_NODE_TABLE")
    read -r node_id host plan_node nproc <<<"$line"
    if [[ -z "$line" || "$host" != "${SLURMD_NODENAME:-$host}" ]]; then
        # Slurm numbered the step's nodes differently from the node lists: go by host name
        line=$(awk -v h="${SLURMD_NODENAME:-}" '$2 == h' <<<"$HEXI_NODE_TABLE")
        if [[ $(grep -c . <<<"$line") != 1 ]]; then
            echo "hexi: cannot tell which plan node Slurm node ${SLURMD_NODENAME:-?} (node id $id) is" >&2
            exit 1
        fi
        read -r node_id host plan_node nproc <<<"$line"
    fi
    export HEXI_PLAN_NODE=$plan_node
    # The first node's agent hosts the rendezvous store and the others connect to it; said
    # explicitly, as agents on machines that share an address would race to host it.
    conf=$HEXI_RDZV_CONF
    if [[ ",$conf" != *,is_host=* ]]; then conf+="${conf:+,}is_host=$((node_id == 0))"; fi
    echo "hexi: Slurm node $host (node id $id) -> plan node $plan_node, $nproc process(es)"
    # "$@": the entry, --hetero-cluster/--hetero-model and the training arguments
    timeout -k 10 "$HEXI_TIMEOUT_S" "$PYTHON" -m torch.distributed.run \
        --nnodes "$HEXI_MIN_NODES:$HEXI_NNODES" --nproc-per-node "$nproc" \
        --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" \
        --rdzv-id "$HEXI_RDZV_ID" --rdzv-conf "$conf" --max-restarts "$HEXI_MAX_RESTARTS" \
        "$@" || rc=$?
    echo "hexi: node exit: plan node $plan_node on $host: torchrun exit $rc"
    return "$rc"
}'''  # noqa: E501 - the shell text's own lines

# After the elastic job's srun: the job's exit status from the nodes' "node exit" lines.
ELASTIC_EXIT = r'''# The job's exit status: 0 when the training finished (a node's torchrun exited 0: its workers
# ran to the end), also when other nodes failed or were lost on the way, which is said; srun's
# status when no node finished.
mapfile -t finished < <(awk '/^hexi: node exit: / && $NF == 0 {print $6}' "$HEXI_STEP_OUT")
lost=()
for p in $(awk '{print $3}' <<<"$HEXI_NODE_TABLE"); do
    if [[ " ${finished[*]} " != *" $p "* ]]; then lost+=("$p"); fi
done
if ((${#finished[@]} == 0)); then
    echo "hexi: job $SLURM_JOB_ID failed: no node finished the training (srun exit $srun_status)" >&2
    exit $((srun_status ? srun_status : 1))
fi
if ((${#lost[@]})); then
    echo "hexi: plan node(s) ${lost[*]} failed or were lost (srun exit $srun_status); the training finished on ${finished[*]}"
fi
echo "hexi: job $SLURM_JOB_ID finished"'''  # noqa: E501 - the shell text's own lines


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
    elastic: ElasticLaunch | None = None,
) -> str:
    """The sbatch script text. `entry`: a script path, '-m module' or '--no-python program';
    default: the installed hexi-train (common.resolve_entry). With `elastic`, `plan` is the whole
    cluster's plan (it gives the nodes and their process counts), `plan_path` the cluster file,
    and the script runs an elastic job (module docstring)."""
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

    kind = f"heterogeneous job, {len(comps)} components:" if het else "plain job:"
    if elastic is None:
        L = [
            "#!/bin/bash",
            "# Generated by `hexi-launch slurm` (megatron-hexi). Edit freely.",
            f"# Plan: {comment(plan_path)}",
            f"#   {plan.world_size} rank(s) on {len(nodes)} node(s); " + kind,
        ]
    else:
        e = elastic
        L = [
            "#!/bin/bash",
            "# Generated by `hexi-launch slurm --elastic` (megatron-hexi). Edit freely.",
            f"# Elastic job (torch elastic): cluster {comment(e.cluster_path)}, model "
            f"{comment(e.model)}, MIN:MAX {e.min_nodes}:{len(nodes)} nodes.",
            "#   The workers plan at every start for the nodes that are there and resume from the",
            "#   last checkpoint; a lost node does not end the job (see the srun step below).",
            f"#   Whole cluster: {plan.world_size} rank(s) on {len(nodes)} node(s); " + kind,
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
        if elastic is not None:  # a node that goes down does not end the allocation
            L.append("#SBATCH --no-kill")
    L += [
        "set -euo pipefail",
        "",
        "# ---- settings (each can be overridden from the environment) ----",
        shell_default("PYTHON", python) + "   # python with megatron-hexi and torch",
        shell_default("MASTER_PORT", int(master_port))
        + ("" if elastic is None else "   # rendezvous port"),
        shell_default("HEXI_TIMEOUT_S", int(timeout_s))
        + "   # torchrun wall limit per node, s (0: none)",
    ]
    if elastic is None:
        L += [
            shell_default("HEXI_PLAN", plan_path),
            ': "${HEXI_MASTER_ADDR:=}"   # empty: first node of component 0',
            "export PYTHON MASTER_PORT HEXI_TIMEOUT_S HEXI_PLAN",
        ]
    else:
        from megatron_hexi.launch.elastic import AGENT_ENV

        L += [
            shell_default("HEXI_MIN_NODES", int(elastic.min_nodes))
            + f"   # fewest nodes to train on (at most {len(nodes)})",
            shell_default("HEXI_MAX_RESTARTS", int(elastic.max_restarts))
            + "   # worker-group restarts after failures",
            shell_default("HEXI_RDZV_ID", elastic.rdzv_id)
            + "   # rendezvous id; the job id is appended",
            shell_default("HEXI_RDZV_CONF", elastic.rdzv_conf or "")
            + "   # torchrun --rdzv-conf; is_host is added per node",
            ': "${HEXI_MASTER_ADDR:=}"   # an address of the first node (empty: its host name)',
            "export PYTHON MASTER_PORT HEXI_TIMEOUT_S HEXI_MIN_NODES HEXI_MAX_RESTARTS "
            "HEXI_RDZV_CONF",
            'export HEXI_RDZV_ID="$HEXI_RDZV_ID-$SLURM_JOB_ID"   # one rendezvous per job',
            "# Every agent needs these: with the rendezvous store shared with the workers, a node",
            "# that joins a running job hangs the rendezvous (megatron_hexi.launch.elastic).",
            *(f"export {k}={sh(v)}" for k, v in AGENT_ENV.items()),
        ]
    L += [
        "",
        "# Training script (absolute), -m module or --no-python program; HEXI_ENTRY in the",
        "# environment replaces it (split at spaces, e.g. HEXI_ENTRY=\"-m my.module\").",
        bash_array("HEXI_ENTRY_WORDS", entry_words(entry)),
        'if [[ -n "${HEXI_ENTRY:-}" ]]; then read -r -a HEXI_ENTRY_WORDS <<<"$HEXI_ENTRY"; fi',
        "",
    ]
    if elastic is None:
        L += [
            "# Training arguments (passed through after --hetero-plan-path):",
            bash_array("TRAINING_ARGS", list(training_args)),
            "",
            "# ---- the plan's nodes per Slurm component, in plan order ----",
            "# component i's k-th Slurm node runs word k of HEXI_PLAN_NODES[i]; a node's",
            "# torchrun node rank is its index in plan order, its process count the plan ranks "
            "on it.",
        ]
    else:
        L += [
            "# What the workers plan from at every start (in place of --hetero-plan-path):",
            bash_array("HEXI_PLAN_WORDS", elastic.training_words()),
            "# Training arguments (passed through after them):",
            bash_array("TRAINING_ARGS", list(training_args)),
            "",
            "# ---- the nodes per Slurm component, in the whole-cluster plan's order ----",
            "# component i's k-th Slurm node is plan node word k of HEXI_PLAN_NODES[i]; its "
            "process count",
            "# is the whole-cluster plan's ranks on it. Each rendezvous numbers the nodes anew.",
        ]
    L.append("HEXI_PLAN_NODES=(")
    for i, c in enumerate(comps):
        L.append(f"    {sh(' '.join(n.name for n in c.nodes))}   # component {i}")
    L.append(")")
    if elastic is None:
        L.append(
            "declare -A HEXI_NODE_RANK=("
            + " ".join(f"[{sh(n.name)}]={n.node_rank}" for n in nodes)
            + ")"
        )
        columns, rank_column = "node-id host plan-node node-rank nproc", " ${HEXI_NODE_RANK[$p]}"
    else:
        columns, rank_column = "node-id host plan-node nproc", ""
    L += [
        "declare -A HEXI_NPROC=(" + " ".join(f"[{sh(n.name)}]={n.nproc}" for n in nodes) + ")",
        f"export HEXI_NNODES={len(nodes)}",
        "",
        f'# ---- map Slurm\'s nodes to plan nodes: "{columns}" ----',
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
        "        HEXI_NODE_TABLE+=\"$node_id ${hosts[$k]} $p"
        + rank_column
        + " ${HEXI_NPROC[$p]}\"$'\\n'",
        "        if [[ $node_id == 0 ]]; then first_host=${hosts[$k]}; fi",
        "        node_id=$((node_id + 1))",
        "    done",
        "done",
        "export HEXI_NODE_TABLE",
        "export MASTER_ADDR=${HEXI_MASTER_ADDR:-$first_host}",
    ]
    if elastic is None:
        L += [
            "echo \"hexi: job $SLURM_JOB_ID, master $MASTER_ADDR:$MASTER_PORT, nodes:\"",
            "printf '%s' \"$HEXI_NODE_TABLE\" | sed 's/^/hexi:   /'",
            "",
            "# ---- per node: become the plan node, run torchrun ----",
            NODE_FUNCTION,
            "",
        ]
    else:
        L += [
            "echo \"hexi: job $SLURM_JOB_ID, elastic $HEXI_MIN_NODES:$HEXI_NNODES nodes, "
            "rendezvous $HEXI_RDZV_ID at $MASTER_ADDR:$MASTER_PORT, nodes:\"",
            "printf '%s' \"$HEXI_NODE_TABLE\" | sed 's/^/hexi:   /'",
            "",
            "# ---- per node: become the plan node, run an elastic torchrun agent ----",
            ELASTIC_NODE_FUNCTION,
            "",
        ]
    srun = ["srun"]
    if het:
        srun.append("--het-group=0-$((SLURM_HET_SIZE - 1))")
    srun.append("--kill-on-bad-exit=1" if elastic is None else "--no-kill --kill-on-bad-exit=0")
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
    run_node = '    bash -c "$(declare -f hexi_node); hexi_node \\"\\$@\\"" hexi_node \\'
    if elastic is None:
        L += [
            " ".join(srun) + " \\",
            run_node,
            '    "${HEXI_ENTRY_WORDS[@]}" --hetero-plan-path "$HEXI_PLAN" "${TRAINING_ARGS[@]}"',
            'echo "hexi: job $SLURM_JOB_ID finished"',
            "",
        ]
        return "\n".join(L)
    L += [
        "# ---- run: one torchrun agent per node ----",
        "# A node that fails does not end the job: with --no-kill and --kill-on-bad-exit=0 the",
        "# other nodes' agents keep running, re-rendezvous within seconds and restart their",
        "# workers, which re-plan for the nodes left and resume from the last checkpoint.",
        "# (Requeue was rejected: it restarts the whole job from the queue and drops the",
        "# surviving agents.) The rendezvous store lives in the agent on the first node",
        "# ($MASTER_ADDR): that node must stay up, its loss ends the job.",
        'HEXI_STEP_OUT=$(mktemp "${TMPDIR:-/tmp}/hexi-$SLURM_JOB_ID.XXXXXX")',
        "trap 'rm -f \"$HEXI_STEP_OUT\"' EXIT",
        "set +e",
        " ".join(srun) + " \\",
        run_node,
        '    "${HEXI_ENTRY_WORDS[@]}" "${HEXI_PLAN_WORDS[@]}" "${TRAINING_ARGS[@]}" \\',
        '    | tee "$HEXI_STEP_OUT"',
        "srun_status=${PIPESTATUS[0]}",
        "set -e",
        ELASTIC_EXIT,
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
