"""--recompute-method / --recompute-num-layers reach megatron-core's TransformerConfig of every
stage (the plan recomputes); without them each stage recomputes uniform 1, the plan's count."""

from megatron_hexi.model import stage_config
from planner.plan import load_plan
from runtime.plans import TWO_STAGES, write_plan


def test_recompute_method_reaches_the_transformer_config(tmp_path):
    plan = load_plan(write_plan(tmp_path, "two", "tiny", 2, TWO_STAGES, recompute=True))
    for rank in range(plan.world_size):
        view = plan.rank_view(rank)
        block = stage_config(
            plan, view, recompute=True, recompute_method="block", recompute_num_layers=2
        )
        assert (block.recompute_granularity, block.recompute_method) == ("full", "block")
        assert block.recompute_num_layers == 2
        default = stage_config(plan, view, recompute=True)
        assert (default.recompute_method, default.recompute_num_layers) == ("uniform", 1)
        off = stage_config(plan, view)
        assert off.recompute_granularity is None
