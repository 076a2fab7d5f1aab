"""Global batches through megatron-core's datasets, cut per pipeline as the plan says.

Global batch i is samples [i x G, (i + 1) x G) of the training dataset, the same under every plan.
Pipeline p reads only its range [start_p, end_p) of each global batch (Plan.sample_range), in
micro-batches of its own size.
"""
from collections import OrderedDict

import torch

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import (GPTDataset, GPTDatasetConfig, MockGPTDataset,
                                                MockGPTLowLevelDataset)


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
    def build_low_level_dataset(dataset_path, config):
        return _SizedMockDocuments(config.tokenizer)


class MockTokenizer:
    """What megatron-core's mock dataset needs of a tokenizer: vocabulary size and EOD id."""

    def __init__(self, vocab_size):
        self.vocab_size = vocab_size
        self.eod = 0
        self.pad = -1
        self.bos = None
        self.unique_identifiers = OrderedDict({"class": "MockTokenizer", "vocab": vocab_size})


def build_train_dataset(args, plan, tokenizer=None):
    """The training split, long enough for every iteration of this run."""
    num_samples = args.train_iters * plan.global_batch_size
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=plan.model.seq_length,
        split=args.split if not args.mock_data else "1,0,0",
        blend=None if args.mock_data else (args.data_path, None),
        tokenizer=tokenizer or MockTokenizer(plan.model.vocab_size),
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask=False, path_to_cache=args.data_cache_path)
    config.mock = args.mock_data
    cls = SizedMockGPTDataset if args.mock_data else GPTDataset
    train, _, _ = BlendedMegatronDatasetBuilder(cls, [num_samples, None, None], lambda: True,
                                                config).build()
    return train


def pipeline_microbatches(dataset, plan, view, iteration):
    """Micro-batches of this rank's pipeline for one iteration (0-based), as dicts of tensors."""
    base = iteration * plan.global_batch_size + view.samples[0]
    mbs = view.micro_batch_size
    for m in range(view.num_microbatches):
        samples = [dataset[base + m * mbs + k] for k in range(mbs)]
        yield {key: torch.stack([s[key] for s in samples]) for key in
               ("tokens", "labels", "loss_mask", "position_ids")}
