"""The data loaders of a training rank: its data-parallel share of the train, validation and
test samples in order (resumable: the train loader starts after the consumed samples), each
batch collated into tensors; a pipeline stage that reads no batch gets placeholders.

`RunLoaders.close` ends the loaders' worker processes (megatron/training/data_workers.py says
why a rank must); a sample that cannot be read (object storage past its retries, an I/O error)
stops the run with one line naming it (`DataError`), not a worker's traceback."""

from __future__ import annotations

import functools
import itertools
import os
from typing import Dict, Iterator, List, Optional, Sequence

import numpy as np
import torch

from megatron import parallel_state
from megatron.config.training import BatchConfig
from megatron.data.datasets.builder import build_datasets, split_sample_counts
from megatron.data.storage import object_storage
from megatron.data.storage.object_storage import ObjectStorage
from megatron.data.data_args import DataSettings
from megatron.data.storage.readahead import ReadAheadBatchSampler, ReadAheadDataset
from megatron.data.datasets.samplers import PretrainingSampler
from megatron.data.datasets.t5_dataset import T5SpecialTokens, collate
from megatron.data.tokenizers.tokenizer import build_tokenizer
from megatron.failures import DataError, RunFailure
from megatron.training.data_workers import StoppableLoader, data_worker_init


class SampleFailure:
    """What a batch becomes when one of its samples could not be read: the message travels
    (pickled, from a worker) to the rank, which raises it as one DataError line (torch would
    re-raise a worker's exception with the worker's whole traceback in its message)."""

    def __init__(self, message: str) -> None:
        self.message = message


class ReportingDataset:
    """`dataset` whose failed reads become a SampleFailure instead of an exception (in a worker
    process or in the rank itself alike); other attributes are the dataset's."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str):
        if name == "dataset":  # not set yet (unpickling)
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __getitems__(self, indices: Sequence[int]) -> list:
        try:
            getitems = getattr(self.dataset, "__getitems__", None)
            return getitems(indices) if getitems is not None \
                else [self.dataset[i] for i in indices]
        except (OSError, RunFailure) as e:  # object storage past its retries, a lost mount
            first, last = min(indices), max(indices)
            return [SampleFailure(f"reading samples {first}..{last}: {e}")]


def collate_tensors(samples: List[Dict[str, np.ndarray]]):
    """The batch as tensors, or the SampleFailure that replaced it."""
    if samples and isinstance(samples[0], SampleFailure):
        return samples[0]
    return {k: torch.from_numpy(v) for k, v in collate(samples).items()}


def _checked(batches: Iterator, split: str) -> Iterator[Dict[str, torch.Tensor]]:
    for batch in batches:
        if isinstance(batch, SampleFailure):
            raise DataError(f"the {split} data: {batch.message}", rank_local=True)
        yield batch


class CheckedLoader(StoppableLoader):
    """A split's loader whose batches are checked for SampleFailure."""

    def __init__(self, split: str, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.split = split

    def __iter__(self):
        return _checked(super().__iter__(), self.split)


class RunLoaders:
    """The run's train, valid and test loaders (None: an empty split); `close()` ends their
    worker processes, on every path out of the run (use as a context manager)."""

    def __init__(self, train, valid, test) -> None:
        self.train, self.valid, self.test = train, valid, test

    def close(self) -> None:
        for loader in (self.train, self.valid, self.test):
            if isinstance(loader, StoppableLoader):
                loader.close()

    def __enter__(self) -> "RunLoaders":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __iter__(self):  # train, valid, test = loaders
        return iter((self.train, self.valid, self.test))


def build_run_datasets(data: DataSettings, batch: BatchConfig,
                       storage: Optional[ObjectStorage] = None) -> Dict[str, object]:
    """{"train"|"valid"|"test": dataset or None}: the samples the run reads, in the order its
    global batches take them (sample i of the split is the i-th one trained on), s3:// data
    through `storage` (None: one made from `data.object_storage`); needs no process group."""
    tokenizer = build_tokenizer(data.tokenizer, extra_ids=data.vocab_extra_ids)
    tokens = T5SpecialTokens.from_tokenizer(tokenizer, whole_word=data.dataset.t5.whole_word)
    counts = split_sample_counts(batch.train_iters, batch.global_batch_size, batch.eval_interval,
                                 batch.eval_iters)
    if storage is None:
        storage = ObjectStorage(data.object_storage)
    return build_datasets(data.dataset, tokens, counts, storage)


def build_data(data: DataSettings, batch: BatchConfig, device_type: str,
               consumed_samples: int, reads_batches: bool = True) -> RunLoaders:
    """The train, valid and test data loaders of this data-parallel rank (None for an empty
    split); the caller closes them.

    reads_batches: False on a pipeline stage that reads no batch (neither the first nor the
    last): its loaders hold as many placeholder batches as the others' and load nothing.
    """
    # the loaders' client, thread pool and caches (DataLoader workers, forked, make their own)
    datasets = build_run_datasets(data, batch, ObjectStorage(data.object_storage))
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
        if remote:  # the next batches' byte ranges fetched ahead (data/storage/readahead.py)
            dataset = ReadAheadDataset(dataset)
            sampler = ReadAheadBatchSampler(sampler, data.object_storage.read_ahead,
                                            data.num_workers)
        # Its own generator: a loader draws a seed from the default one at every iter(), which
        # would shift the dropout masks after a resume or an evaluation.
        loaders.append(CheckedLoader(
            name, ReportingDataset(dataset), batch_sampler=sampler, collate_fn=collate_tensors,
            generator=torch.Generator().manual_seed(data.seed),
            num_workers=data.num_workers, pin_memory=device_type == "cuda",
            persistent_workers=data.num_workers > 0 and name != "train",
            worker_init_fn=functools.partial(data_worker_init, rank_pid=os.getpid())
            if data.num_workers > 0 else None))
    return RunLoaders(*loaders)


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
