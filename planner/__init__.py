"""The megatron-hexi planner: plan format, cluster and model specs, cost model and search.

Pure Python: it imports neither torch nor megatron, so it installs and runs on any laptop.
"""

from planner.errors import ClusterError, ModelSpecError, PlanError, SpecError
from planner.plan import Plan, RankView, build_plan, load_plan, plan_from_dict, save_plan

__all__ = [
    "Plan",
    "RankView",
    "build_plan",
    "load_plan",
    "plan_from_dict",
    "save_plan",
    "SpecError",
    "PlanError",
    "ClusterError",
    "ModelSpecError",
]
