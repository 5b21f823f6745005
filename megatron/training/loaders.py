"""The data loaders of a training rank: its data-parallel share of the train, validation and
test samples in order (resumable: the train loader starts after the consumed samples), each
batch collated into tensors; a pipeline stage that reads no batch gets placeholders."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
from typing import Dict, List

import numpy as np
import torch

from megatron import parallel_state
from megatron.config.training import BatchConfig
from megatron.data.builder import build_datasets, split_sample_counts
from megatron.data import object_storage
from megatron.data.data_args import DataSettings
from megatron.data.readahead import ReadAheadBatchSampler, ReadAheadDataset
from megatron.data.samplers import PretrainingSampler
from megatron.data.t5_dataset import T5SpecialTokens, collate
from megatron.data.tokenizer import build_tokenizer
from megatron.training.signals import data_worker_init


def collate_tensors(samples: List[Dict[str, np.ndarray]]) -> Dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v) for k, v in collate(samples).items()}


def build_run_datasets(data: DataSettings, batch: BatchConfig) -> Dict[str, object]:
    """{"train"|"valid"|"test": dataset or None}: the samples the run reads, in the order its
    global batches take them (sample i of the split is the i-th one trained on); needs no
    process group."""
    tokenizer = build_tokenizer(data.tokenizer, extra_ids=data.vocab_extra_ids)
    tokens = T5SpecialTokens.from_tokenizer(tokenizer, whole_word=data.dataset.t5.whole_word)
    counts = split_sample_counts(batch.train_iters, batch.global_batch_size, batch.eval_interval,
                                 batch.eval_iters)
    return build_datasets(data.dataset, tokens, counts)


def build_data(data: DataSettings, batch: BatchConfig, device_type: str,
               consumed_samples: int, reads_batches: bool = True):
    """(train, valid, test) data loaders for this data-parallel rank (None for an empty split).

    reads_batches: False on a pipeline stage that reads no batch (neither the first nor the
    last): its loaders hold as many placeholder batches as the others' and load nothing.
    """
    object_storage.configure(**dataclasses.asdict(data.object_storage))
    datasets = build_run_datasets(data, batch)
    remote = any(object_storage.is_remote(p) for p in data.dataset.data_path)
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    loaders = []
    for name in ("train", "valid", "test"):
        dataset = datasets.get(name)
        if dataset is None:
            loaders.append(None)
            continue
        sampler = PretrainingSampler(len(dataset), consumed_samples if name == "train" else 0,
                                     batch.micro_batch_size, dp_rank, dp_size, drop_last=True)
        if not reads_batches:
            loaders.append(UnreadBatches(len(sampler)))
            continue
        if remote:  # byte ranges of the next batches fetched ahead (megatron/data/readahead.py)
            dataset = ReadAheadDataset(dataset)
            sampler = ReadAheadBatchSampler(sampler, data.object_storage.read_ahead,
                                            data.num_workers)
        # Its own generator: a loader draws a seed from the default one at every iter(), which
        # would shift the dropout masks after a resume or an evaluation.
        loaders.append(torch.utils.data.DataLoader(
            dataset, batch_sampler=sampler, collate_fn=collate_tensors,
            generator=torch.Generator().manual_seed(data.seed),
            num_workers=data.num_workers, pin_memory=device_type == "cuda",
            persistent_workers=data.num_workers > 0 and name != "train",
            worker_init_fn=functools.partial(data_worker_init, rank_pid=os.getpid())
            if data.num_workers > 0 else None))
    return tuple(loaders)


class UnreadBatches:
    """A loader's stand-in on a pipeline stage that reads no batch: as many (empty) batches as
    the loader of the stages that do, so that every stage runs the same number of steps and
    evaluation steps."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __iter__(self):
        return itertools.repeat({}, self.length)
