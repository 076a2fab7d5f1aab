"""What both launchers need from a plan: the nodes it uses, in plan order, with their process
counts; and the one way values enter generated text (`sh`, `shell_default`, `comment`,
`directive_value`), so that no name, path or option can run as a command. Node names are checked
once, in `plan_nodes`, by the planner's name rule: a name that passes is one shell word, one word
of the sbatch node table and a file name inside its folder (`file_in`).

The runtime maps a process to its plan rank from (HEXI_PLAN_NODE, LOCAL_RANK), falling back to the
host name and then to launch order. The launchers give every node torchrun node rank = its index
in plan order and --nproc-per-node = the plan ranks it holds, so torch's global rank equals the plan
rank as well (torchrun numbers ranks node rank by node rank).
"""

from __future__ import annotations

import os
import re
import shlex
import sys
import sysconfig
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from planner.errors import SpecError
from planner.inputs import name_problem

if TYPE_CHECKING:
    from planner.plan import Plan, RankEntry


class LaunchError(SpecError):
    """A plan or option the launchers cannot turn into a job (one line per problem, exit 2)."""


@dataclass(frozen=True)
class PlanNode:
    name: str  # plan node name (a100-0), exported as HEXI_PLAN_NODE
    group: str  # cluster node group
    gpu: str  # catalog GPU type
    nproc: int  # plan ranks on this node = torchrun --nproc-per-node
    node_rank: int  # index in plan order = torchrun --node-rank
    first_rank: int  # plan rank of local rank 0
    gpus_per_node: int  # GPUs the machine has (cluster spec)
    hostname: Optional[str]
    partition: Optional[str]  # from the cluster spec, if given there


def plan_nodes(plan: Plan) -> list[PlanNode]:
    """The plan's nodes in plan order (by first rank). Refuses node names that are not safe
    names and layouts torchrun cannot start."""
    cluster_nodes = {n.name: n for n in plan.cluster.nodes}
    groups = {g.name: g for g in plan.cluster.groups}
    order: list[str] = []
    ranks_of: dict[str, list[RankEntry]] = {}
    for r in plan.ranks:
        if r.node not in ranks_of:
            order.append(r.node)
            ranks_of[r.node] = []
        ranks_of[r.node].append(r)
    # Node names become shell words, words of the sbatch node table and file names: the one
    # check of them is here, by the planner's rule, also for a plan that skipped its validation.
    problems = [p for name in order if (p := name_problem(name, "plan node", "node name"))]
    if problems:
        raise LaunchError(problems)
    out = []
    for i, name in enumerate(order):
        rs = ranks_of[name]
        node = cluster_nodes[name]
        first = rs[0].rank
        if [r.rank for r in rs] != list(range(first, first + len(rs))):
            problems.append(
                f"ranks: the ranks on node {name} are not consecutive "
                f"({[r.rank for r in rs]}); torchrun starts a node's processes as one "
                f"block of ranks"
            )
        if sorted(r.local_rank for r in rs) != list(range(len(rs))):
            problems.append(
                f"ranks: node {name} uses local ranks {[r.local_rank for r in rs]}; "
                f"torchrun gives local ranks 0..{len(rs) - 1}"
            )
        out.append(
            PlanNode(
                name,
                node.group,
                node.gpu,
                len(rs),
                i,
                first,
                node.gpus_per_node,
                node.hostname,
                groups[node.group].partition,
            )
        )
    if out and out[0].first_rank != 0:
        problems.append("ranks: rank 0 must be on the first node")
    if problems:
        raise LaunchError(problems)
    return out


_NOISE = re.compile(r"^(nvidia|geforce|tesla|sxm\d*|pcie|nvl|hbm\d*e?|\d+gb)$", re.IGNORECASE)


def default_gres_type(gpu: str) -> str | None:
    """Slurm gres type for a catalog GPU name: lowercase, vendor/form-factor/memory dropped.

    A100-SXM-80GB -> a100, RTX-4090 -> rtx4090, H100-PCIE -> h100, RTX-3080-Ti -> rtx3080ti,
    CPU -> None (no GPU to request). Sites name their types freely: override with --gres-type.
    """
    if gpu.upper() == "CPU":
        return None
    parts = [p for p in re.split(r"[-_ ]+", gpu) if p and not _NOISE.match(p)]
    return "".join(parts).lower() or gpu.lower()


def parse_mapping(
    items: Iterable[str] | None, flag: str, allow_bare: bool = False
) -> dict[str, str]:
    """--flag KEY=VALUE (repeatable) -> {key.lower(): value}; a bare VALUE goes to key '*'.
    Values are checked where they are used (slurm.components)."""
    out = {}
    for item in items or []:
        key, eq, value = item.partition("=")
        if not eq:
            if allow_bare and item:
                out["*"] = item
                continue
            raise LaunchError(f"{flag} {item!r}: expected GPU=VALUE (e.g. {flag} RTX-4090=...)")
        if not key or not value:
            raise LaunchError(f"{flag} {item!r}: expected GPU=VALUE with both sides non-empty")
        # GPU types and node group names follow the planner's name rule: a key outside it (a
        # bare value with '=' in it, a line break) would silently match nothing
        bad = name_problem(key.strip(), f"{flag} {item!r}", "GPU type or node group name")
        if bad:
            raise LaunchError(bad)
        out[key.strip().lower()] = value.strip()
    return out


def lookup(mapping: Mapping[str, str], node: PlanNode) -> str | None:
    """Value for a node from a mapping keyed by node group name, GPU type or '*'."""
    for key in (node.group.lower(), node.gpu.lower(), "*"):
        if key in mapping:
            return mapping[key]
    return None


def sh(value: object) -> str:
    """`value` as one shell word, exactly (shlex.quote). Every value a generator puts into shell
    text goes through here, so no name, path or argument can run as a command."""
    return shlex.quote(str(value))


TRAIN_COMMAND = "hexi-train"  # setup.py's console script for megatron_hexi.entry:cli
NO_PYTHON = "--no-python "  # torchrun runs the entry as a program, not as `python ENTRY`


def entry_words(entry: str) -> list[str]:
    """What runs on every rank, as argv words: `-m MODULE` and `--no-python PROGRAM` are two
    words, a script path one."""
    return entry.split(" ", 1) if entry.startswith(("-m ", NO_PYTHON)) else [entry]


def resolve_entry(entry: str | None, python: str) -> str:
    """The training entry torchrun runs on every node, never relative to the directory the job
    happens to start in. A script given that exists here becomes absolute. Without one, it is
    the `hexi-train` script installed beside the nodes' `python` (absolute); a bare interpreter
    name (`python` in a container) has no directory to look in, so torchrun then runs
    `hexi-train` from the node's PATH, as the shell finds `python` itself."""
    if entry is not None:
        if not entry.startswith(("-m ", NO_PYTHON)) and os.path.exists(entry):
            return os.path.abspath(entry)
        return entry
    if os.sep not in python:
        return NO_PYTHON + TRAIN_COMMAND
    python = os.path.abspath(python)
    beside = os.path.join(os.path.dirname(python), TRAIN_COMMAND)
    if not os.path.exists(python) or os.path.exists(beside):
        return beside  # an interpreter on the nodes only is taken at its word
    if os.path.realpath(python) == os.path.realpath(sys.executable):
        user = os.path.join(sysconfig.get_path("scripts", f"{os.name}_user"), TRAIN_COMMAND)
        if os.path.exists(user):  # pip install --user
            return user
    raise LaunchError(
        f"no {TRAIN_COMMAND} beside {python}: install megatron-hexi for that python "
        f"(pip install -e .), or name the training script with --entry"
    )


def quote_args(args: Iterable[object]) -> str:
    return " ".join(sh(a) for a in args)


def shell_default(var: str, value: object) -> str:
    """`VAR=${VAR:-'value'}`: a setting the environment can override, with a quoted default."""
    return f"{var}=${{{var}:-{sh(value)}}}"


def comment(text: object) -> str:
    """`text` for a `# ...` line: control characters written as escapes, so that a line break in
    a name cannot end the comment and start a command."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


_DIRECTIVE_SPECIAL = "'\"\\#"


def directive_value(value: object, what: str) -> str:
    """`value` checked for an `#SBATCH` line. sbatch, not the shell, reads these lines: a line
    break would end the directive and start a shell line, and whitespace, quotes, backslashes and
    '#' change how sbatch splits it. No quoting helps there, so such values are refused."""
    if not isinstance(value, str) or not value:
        raise LaunchError(f"{what}: must be one name (a non-empty string), got {value!r}")
    bad = [
        c
        for c in dict.fromkeys(value)
        if not c.isprintable() or c.isspace() or c in _DIRECTIVE_SPECIAL
    ]
    if bad:
        raise LaunchError(
            f"{what} {value!r}: an #SBATCH value cannot contain "
            f"{', '.join(repr(c) for c in bad)} (no whitespace, control "
            f"characters, quotes, backslashes or '#')"
        )
    for word in ("hetjob", "packjob"):
        if word in value.lower():
            raise LaunchError(
                f"{what} {value!r}: sbatch takes {word!r} anywhere in an #SBATCH "
                f"line for a component separator"
            )
    return value


def file_in(folder: str, name: str, suffix: str) -> str:
    """Path of the file `name + suffix` directly inside `folder`, for a plan node's name.

    No confinement check here: it would be redundant. `plan_nodes` lets through only names of
    the planner's rule (letters, digits, '.', '_', '-'), which hold no separator, and with a
    non-empty suffix not even '.' or '..' names a folder ('.sh', '...sh')."""
    return os.path.join(folder, f"{name}{suffix}")


def bash_array(name: str, items: Sequence[object], indent: str = "    ", width: int = 96) -> str:
    """`name=(...)` with shell-quoted items, wrapped for reading."""
    if not items:
        return f"{name}=()"
    lines, cur = [], f"{name}=("
    for q in (sh(a) for a in items):
        if len(cur) + len(q) + 1 > width and not cur.endswith("("):
            lines.append(cur)
            cur = indent + q
        else:
            cur = cur + ("" if cur.endswith("(") else " ") + q
    lines.append(cur + ")")
    return "\n".join(lines)
