"""Global batches through megatron-core's datasets, cut per pipeline as the plan says.

Global batch i is samples [i x G, (i + 1) x G) of the training dataset, the same under every plan.
Pipeline p reads only its range [start_p, end_p) of each global batch (Plan.sample_range), in
micro-batches of its own size.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import (
    GPTDataset,
    GPTDatasetConfig,
    MockGPTDataset,
    MockGPTLowLevelDataset,
)
from megatron.core.datasets.utils import Split

from megatron_hexi.index_file import IndexSummary, check_index
from planner.errors import SpecError

if TYPE_CHECKING:
    from megatron.core.datasets.blended_megatron_dataset_builder import TopLevelDataset

    from megatron_hexi.config import DataConfig
    from megatron_hexi.tokenizer import TextTokenizer
    from planner.plan import Plan, RankView


class _SizedMockDocuments(MockGPTLowLevelDataset):
    """megatron-core's mock corpus, 4,000 documents instead of 100,000.

    Indexing 100,000 documents of up to 4,096 tokens costs seconds in every process; 4,000 (about
    8M tokens) are plenty for mock runs, and GPTDataset starts a new epoch when they run out. The
    size is fixed so that the data order never depends on the run's length.
    """

    size = 4000


class SizedMockGPTDataset(MockGPTDataset):
    """MockGPTDataset over the smaller mock corpus."""

    @staticmethod
    def build_low_level_dataset(
        dataset_path: str | None, config: GPTDatasetConfig
    ) -> _SizedMockDocuments:
        return _SizedMockDocuments(config.tokenizer)


class MockTokenizer:
    """What megatron-core's mock dataset needs of a tokenizer: vocabulary size and EOD id."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.eod = 0
        self.pad = -1
        self.bos = None
        self.unique_identifiers = OrderedDict({"class": "MockTokenizer", "vocab": vocab_size})


def build_train_dataset(
    data: DataConfig,
    plan: Plan,
    *,
    train_iters: int,
    seed: int,
    tokenizer: TextTokenizer | None = None,
) -> TopLevelDataset:
    """The training split of `data`, long enough for `train_iters` iterations of the plan, its
    sample order drawn from `seed`; `tokenizer` is the corpus's (None: a mock one for mock data)."""
    num_samples = train_iters * plan.global_batch_size
    if not data.mock_data:
        return _build_real_dataset(data, plan, seed, tokenizer, num_samples, Split.train)
    # All mock documents train (split 1,0,0): the training order stays the one it always was.
    return _build_mock_dataset(plan, seed, "1,0,0", Split.train, num_samples, data)


def build_valid_dataset(
    data: DataConfig,
    plan: Plan,
    *,
    num_samples: int,
    seed: int,
    tokenizer: TextTokenizer | None = None,
) -> TopLevelDataset:
    """The validation samples of `data`: `valid_data_path` when given, else the validation split
    of `split` (mock data: megatron-core's mock documents of that split, which the training
    samples also draw from: mock text has nothing to generalise to)."""
    if not data.mock_data:
        return _build_real_dataset(data, plan, seed, tokenizer, num_samples, Split.valid)
    return _build_mock_dataset(plan, seed, data.split, Split.valid, num_samples, data)


def _build_mock_dataset(
    plan: Plan, seed: int, split: str, which: Split, num_samples: int, data: DataConfig
) -> TopLevelDataset:
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=plan.model.seq_length,
        split=split,
        blend=None,
        tokenizer=MockTokenizer(plan.model.vocab_size),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        path_to_cache=data.data_cache_path,
    )
    config.mock = True
    _only_split(config, which, data)
    sizes: list[int | None] = [None, None, None]
    sizes[which.value] = num_samples
    return BlendedMegatronDatasetBuilder(SizedMockGPTDataset, sizes, lambda: True, config).build()[
        which.value
    ]


def _only_split(config: GPTDatasetConfig, which: Split, data: DataConfig) -> None:
    """Build only split `which`: its documents are those --split gives it, and its sample order
    is the one megatron-core gives it whatever the other splits are (the random state depends
    only on the seed). The test split is never read."""
    if config.split_matrix is None:  # blend_per_split (--valid-data-path)
        return
    if config.split_matrix[which.value] is None:
        raise SpecError(
            f"--split {data.split} leaves no documents for "
            + ("training" if which == Split.train else "validation (or give --valid-data-path)")
        )
    config.split_matrix = [
        part if i == which.value else None for i, part in enumerate(config.split_matrix)
    ]


def data_blend(
    data_path: Sequence[object], flag: str = "--data-path"
) -> tuple[list[str], list[float] | None]:
    """--data-path in Megatron's syntax -> (prefixes, weights or None); SpecError if malformed.

    `PREFIX [PREFIX ...]` (blended in proportion to their sizes) or `W1 PREFIX1 W2 PREFIX2 ...`
    with every weight a finite number > 0 (megatron-core's BlendedDataset refuses a 0 weight).
    """
    from megatron.core.datasets.utils import get_blend_from_list

    items = [str(x) for x in data_path]
    numeric = [_is_number(x) for x in items]
    if any(numeric[0::2]) and (len(items) % 2 or not all(numeric[0::2])):
        raise SpecError(
            f"{flag} {' '.join(items)}: give either prefixes only or 'weight prefix' pairs"
        )
    prefixes, weights = get_blend_from_list(items)
    if weights is not None:
        for text, weight, prefix in zip(items[0::2], weights, prefixes, strict=True):
            if not (math.isfinite(weight) and weight > 0):
                raise SpecError(
                    f"{flag}: weight {text} of {prefix}: blend weights must be finite "
                    f"numbers > 0 (leave a prefix out rather than give it 0)"
                )
    return prefixes, weights


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def check_indexed_datasets(
    prefixes: Sequence[str], flag: str = "--data-path"
) -> dict[str, IndexSummary]:
    """Every prefix has a readable .bin/.idx pair whose .idx is consistent with its own size and
    with the .bin, and holds a token (megatron_hexi.index_file). Checked on every rank before
    megatron-core's builder, which builds on rank 0 first while the others wait in a barrier (a
    failure there would leave them waiting until the timeout)."""
    summaries = {}
    for prefix in prefixes:
        missing = [prefix + ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
        if missing:
            hint = (
                f"; did you mean {prefix}_text_document (tools/preprocess_data.py names its "
                f"output PREFIX_KEY_document)?"
                if os.path.isfile(prefix + "_text_document.bin")
                else " (make it with tools/preprocess_data.py)"
            )
            raise SpecError(f"{flag} {prefix}: {' and '.join(missing)} not found{hint}")
        try:
            summaries[prefix] = check_index(prefix, flag)
        except OSError as e:
            raise SpecError(f"{flag} {prefix}: cannot read ({e.strerror})") from None
    return summaries


def check_split_tokens(
    split_matrix: Sequence[tuple[float, float] | None],
    which: Split,
    summaries: dict[str, IndexSummary],
    data: DataConfig,
) -> None:
    """Each prefix's part of split `which` holds a token. megatron-core cuts every prefix's
    sequences by the split (its own rounding, repeated here) and counts epochs until a part gives
    the samples asked of it: an empty part never does, and the count never ends."""
    part = split_matrix[which.value]
    if part is None:
        return
    name = {Split.train: "training", Split.valid: "validation", Split.test: "test"}[which]
    for prefix, summary in summaries.items():
        count = len(summary.lengths)
        begin, end = int(round(part[0] * float(count))), int(round(part[1] * float(count)))
        if int(summary.lengths[begin:end].sum(dtype="int64")) == 0:
            raise SpecError(
                f"--split {data.split}: the {name} part of {prefix} ({end - begin} of its "
                f"{count} sequences) holds no tokens; give that part more weight or the "
                f"prefix more documents"
            )


def _build_real_dataset(
    data: DataConfig,
    plan: Plan,
    seed: int,
    tokenizer: TextTokenizer | None,
    num_samples: int,
    which: Split,
) -> TopLevelDataset:
    """megatron-core's GPTDataset (BlendedDataset over several prefixes) for one split: of
    --data-path under --split, or of --valid-data-path for validation when given."""
    from megatron_hexi.plan_flags import vocab_problem
    from megatron_hexi.tokenizer import check_vocab_fits

    if tokenizer is None:
        raise SpecError("--data-path needs --tokenizer-type and its tokenizer files")
    check_vocab_fits(tokenizer, plan.model.vocab_size)
    padding = vocab_problem(
        tokenizer.vocab_size, data.make_vocab_size_divisible_by, plan, "the tokenizer"
    )
    if padding:
        raise SpecError(padding)
    own_blend = data.valid_data_path if which == Split.valid else None
    flag = "--valid-data-path" if own_blend else "--data-path"
    assert data.data_path is not None
    prefixes, weights = data_blend(own_blend or data.data_path, flag)
    summaries = check_indexed_datasets(prefixes, flag)
    per_split: list[tuple[list[str], list[float] | None] | None] = [None, None, None]
    per_split[which.value] = (prefixes, weights)
    try:
        config = GPTDatasetConfig(
            random_seed=seed,
            sequence_length=plan.model.seq_length,
            split=None if own_blend else data.split,
            blend=None if own_blend else (prefixes, weights),
            blend_per_split=per_split if own_blend else None,
            tokenizer=tokenizer,
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=False,
            create_attention_mask=False,
            path_to_cache=data.data_cache_path,
            mmap_bin_files=data.mmap_bin_files,
        )
    except (AssertionError, ValueError) as e:
        raise SpecError(f"--split {data.split}: {e or 'malformed'}") from None
    _only_split(config, which, data)
    check_split_tokens(config.split_matrix or [(0.0, 1.0)] * 3, which, summaries, data)
    sizes = [0, 0, 0]
    sizes[which.value] = num_samples
    built = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
    dataset = built[which.value]
    if dataset is None or len(dataset) < num_samples:
        have = 0 if dataset is None else len(dataset)
        raise SpecError(
            f"{flag}: the {which.name} split gives {have} samples, {num_samples} "
            f"are needed"
            + (
                "; prefixes without weights are read once each (Megatron's rule): "
                "give weights ('W1 PREFIX1 W2 PREFIX2') to repeat them"
                if weights is None and len(prefixes) > 1
                else ""
            )
        )
    return dataset


def pipeline_microbatches(
    dataset: TopLevelDataset, plan: Plan, view: RankView, iteration: int
) -> Iterator[dict[str, torch.Tensor]]:
    """Micro-batches of this rank's pipeline for one iteration (0-based), as dicts of tensors."""
    base = iteration * plan.global_batch_size + view.samples[0]
    mbs = view.micro_batch_size
    for m in range(view.num_microbatches):
        samples = [dataset[base + m * mbs + k] for k in range(mbs)]
        yield {
            key: torch.stack([s[key] for s in samples])
            for key in ("tokens", "labels", "loss_mask", "position_ids")
        }
