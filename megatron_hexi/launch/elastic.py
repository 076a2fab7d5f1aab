"""`hexi-launch ... --elastic`: what an elastic job needs before its scripts are written.

An elastic job is launched from a cluster file, not a plan: its workers plan at every start
(pretrain_gpt.py --hetero-cluster) for the nodes that are there. The launcher still plans once,
for the whole cluster, to know how many processes each node runs (the GPUs that plan uses there)
and to refuse training flags that cannot work, and finds MIN, the fewest nodes the model fits on
(planner.membership.smallest_fitting_nodes), unless it is given.

The agents rendezvous through torch elastic's c10d backend. The rendezvous store lives in the
agent on the endpoint's node: that node must stay up (a lost endpoint ends the job).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_hexi.arguments import parse_args, planning_inputs
from megatron_hexi.launch.common import LaunchError
from planner.membership import plan_for, smallest_fitting_nodes
from planner.plan import Plan
from planner.search_islands import plan_islands

# torch elastic shares the rendezvous TCPStore with the workers by default; with it shared, a
# node that joins a running job waits forever for a master address that no agent publishes
# (measured with torch 2.13 on localhost agents). Each round then gets a store of its own.
AGENT_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
# Flags an elastic run needs (flag: its parsed name): it resumes from its own checkpoints
# under whatever plan a start makes.
RESUME_FLAGS = {
    "--save": "save",
    "--load": "load",
    "--hetero-load-if-exists": "hetero_load_if_exists",
}


@dataclass(frozen=True)
class ElasticLaunch:
    """The torchrun settings of an elastic job (the same on every node)."""

    cluster_path: str  # absolute: the workers read it at every start
    model: str
    min_nodes: int
    max_nodes: int
    max_restarts: int
    rdzv_id: str
    rdzv_conf: str | None

    def training_words(self) -> list[str]:
        """What replaces --hetero-plan-path on the training command line."""
        return ["--hetero-cluster", self.cluster_path, "--hetero-model", self.model]


@dataclass(frozen=True)
class ElasticSetup:
    """The whole-cluster plan (nodes and processes per node), the job's settings, and the
    training arguments to pass (--exit-signal-handler added when missing)."""

    plan: Plan
    launch: ElasticLaunch
    training_args: list[str]
    min_nodes_reason: str


def elastic_setup(
    cluster_path: str,
    model: str,
    training_args: Sequence[str],
    min_nodes: int | None,
    max_restarts: int,
    rdzv_id: str,
    rdzv_conf: str | None,
) -> ElasticSetup:
    """Check the training arguments as pretrain_gpt.py will, plan the whole cluster and find
    MIN; LaunchError or the planner's SpecError on a problem."""
    args = parse_args([*training_args, "--hetero-cluster", cluster_path, "--hetero-model", model])
    missing = [flag for flag, name in RESUME_FLAGS.items() if not getattr(args, name)]
    if missing or args.save != args.load:
        raise LaunchError(
            "an elastic job resumes from its own checkpoints after every restart: give "
            "--save DIR --load DIR (the same DIR) --hetero-load-if-exists (a --save-interval "
            "bounds the steps a lost node costs)"
            + (f" (missing: {' '.join(missing)})" if missing else "")
        )
    # only the layout counts here (nodes and processes); each start's workers choose the
    # transformer implementation where they run, which changes no layout
    inputs = planning_inputs(args, cuda=False)
    in_file = len(inputs.cluster.nodes)
    if min_nodes is not None and not 1 <= min_nodes <= in_file:  # said before any search
        raise LaunchError(f"--min-nodes {min_nodes}: must be 1..{in_file} (the cluster's nodes)")
    if min_nodes is None:  # its search plans the whole cluster too
        fit = smallest_fitting_nodes(inputs.cluster, inputs.model, inputs.options)
        plan = fit.whole
        min_nodes = min(fit.count, len({r.node for r in plan.ranks}))
        reason = (
            f"MIN {min_nodes}: the model fits on the {fit.count} node(s) with the least GPU "
            f"memory ({', '.join(fit.nodes)})"
        )
    else:
        plan = plan_for(inputs.cluster, inputs.model, inputs.options)
        reason = f"MIN {min_nodes}: given (--min-nodes)"
    if inputs.islands.mode != "off":  # the whole cluster's plan as its first start makes it
        plan = plan_islands(inputs.cluster, inputs.model, inputs.options, inputs.islands)
    nodes = len({r.node for r in plan.ranks})
    if not 1 <= min_nodes <= nodes:
        raise LaunchError(f"--min-nodes {min_nodes}: must be 1..{nodes} (the job's nodes)")
    words = list(training_args)
    if not args.exit_signal_handler:
        words.append("--exit-signal-handler")
    if os.path.isfile(model):  # a model YAML: the workers may start elsewhere
        model = os.path.abspath(model)
    launch = ElasticLaunch(
        os.path.abspath(cluster_path), model, min_nodes, nodes, max_restarts, rdzv_id, rdzv_conf
    )
    return ElasticSetup(plan, launch, words, reason)


__all__ = ["AGENT_ENV", "ElasticLaunch", "ElasticSetup", "elastic_setup", "RESUME_FLAGS"]
