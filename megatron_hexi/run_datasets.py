"""The datasets of a run and the validation window each evaluation reads.

Every rank builds them: megatron-core's dataset builder synchronises the whole world (rank 0
builds first); only first and last stages read from them. The training dataset is long enough for
the run's iterations; the validation dataset holds one window of eval_iters global batches per
evaluation the run can make, and which window an evaluation reads depends on its iteration only,
so a resumed run evaluates the batches an uninterrupted one would.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from megatron_hexi.distributed import startup_line

if TYPE_CHECKING:
    from megatron.core.datasets.blended_megatron_dataset_builder import TopLevelDataset

    from megatron_hexi.config import EvaluationConfig, RunConfig
    from megatron_hexi.tokenizer import TextTokenizer
    from planner.plan import Plan


class RunDatasets(NamedTuple):
    """A run's training dataset, and its validation dataset (None without evaluations)."""

    train: TopLevelDataset
    valid: TopLevelDataset | None


def run_datasets(plan: Plan, config: RunConfig) -> RunDatasets:
    """Both datasets of a run, with its corpus's tokenizer; says on the start-up line how many
    samples each holds."""
    from megatron_hexi.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(config.data)
    train = build_dataset(plan, config, tokenizer)
    valid = build_valid_dataset(plan, config, tokenizer) if config.evaluation.batches else None
    startup_line(
        f"data ready: {len(train)} training samples"
        + (f", {len(valid)} validation samples" if valid is not None else "")
    )
    return RunDatasets(train, valid)


def build_dataset(
    plan: Plan, config: RunConfig, tokenizer: TextTokenizer | None
) -> TopLevelDataset:
    """The training dataset of a run: its DataConfig, long enough for its iterations, in the order
    its seed draws; `tokenizer` is its corpus's (None for mock data)."""
    from megatron_hexi.data import build_train_dataset

    return build_train_dataset(
        config.data,
        plan,
        train_iters=config.training.train_iters,
        seed=config.training.seed,
        tokenizer=tokenizer,
    )


def build_valid_dataset(
    plan: Plan, config: RunConfig, tokenizer: TextTokenizer | None
) -> TopLevelDataset:
    """The validation samples of a run: one window of eval_iters global batches per evaluation
    it can make (every eval_interval iterations, and one at the end), Megatron-LM's count."""
    from megatron_hexi.data import build_valid_dataset as build

    ev, iters = config.evaluation, config.training.train_iters
    windows = eval_window(iters, iters, ev, end=True) + 1
    return build(
        config.data,
        plan,
        num_samples=windows * ev.batches * plan.global_batch_size,
        seed=config.training.seed,
        tokenizer=tokenizer,
    )


def eval_window(iteration: int, train_iters: int, ev: EvaluationConfig, *, end: bool) -> int:
    """Which window of validation batches the evaluation at `iteration` reads: the k-th
    evaluation every eval_interval reads window k - 1, the one at the end of a run the next.
    A function of the iteration alone, so a resumed run evaluates the batches an uninterrupted
    one would (Megatron-LM's iterator moves on in the same way). A checkpoint past
    `train_iters` (--skip-train on it) reads the last window there is."""
    if not ev.eval_interval:
        return 0
    window = min(iteration, train_iters) // ev.eval_interval
    return window if end else window - 1
