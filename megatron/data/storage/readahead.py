"""Reading ahead of the sampler for data on object storage (megatron/data/storage/object_storage.py).

The sampler's order is fixed in advance, so the byte ranges a batch will read are known before it
is read: `ReadAheadBatchSampler` hands each batch to the loader with the indices of the next
`depth` batches that the same process (the same DataLoader worker: batch j goes to worker
j mod W) will build; `ReadAheadDataset.__getitems__` (the DataLoader's batched fetch) first
starts fetching those batches' ranges, then fetches its own batch's ranges that are neither
cached nor under way, all at once and concurrently, and only then builds the samples, which read
from the cache. A rank reads its own data-parallel share only (the sampler gives it nothing
else), and a pipeline stage that reads no batch builds no loader.

The ranges of a sample come from its dataset, which says which byte ranges building sample i
reads without reading them: `sample_reads(i)`, a list of (RemoteBin, start, end) in the order
the build reads them (IndexedDataset.reads / slice_reads underneath). T5 span corruption, UL2,
Megatron T5 and blends (to the part that holds the sample) give all of a sample's reads; CPM-2
gives its context's, and the target spans, whose place depends on the context's values, are
read when the sample is built. Planning costs a fraction of the sample's build (bench/
RESULTS.md, "object storage"); an error in it (a sample out of range, a dataset that cannot
plan) is raised, as building the sample would raise it.
"""

from __future__ import annotations

import collections
from typing import Dict, Iterable, List, Sequence, Tuple


def planned_ranges(dataset, indices: Iterable[int]) -> Dict[object, List[Tuple[int, int]]]:
    """{RemoteBin: [(start, end), ...]} that building samples `indices` of `dataset` reads
    (`dataset.sample_reads`), each RemoteBin's in the order they are read."""
    out: Dict[object, List[Tuple[int, int]]] = collections.defaultdict(list)
    for index in indices:
        for remote, start, end in dataset.sample_reads(int(index)):
            out[remote].append((start, end))
    return out


class AheadBatch(list):
    """A batch of sample indices carrying `ahead`: the indices of the next batches that the
    same loader process builds (pickles with it to a DataLoader worker)."""

    ahead: Sequence[int] = ()


class ReadAheadBatchSampler:
    """`batch_sampler` whose batches carry the indices of the `depth` next batches of the same
    loader process (`workers` DataLoader workers take batches in turn; 0 or 1: one process)."""

    def __init__(self, batch_sampler, depth: int, workers: int) -> None:
        self.batch_sampler, self.depth, self.stride = batch_sampler, depth, max(1, workers)

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self):
        window = self.depth * self.stride
        source = iter(self.batch_sampler)
        buffered = collections.deque()
        done = False
        while True:
            while not done and len(buffered) <= window:
                try:
                    buffered.append(next(source))
                except StopIteration:
                    done = True
            if not buffered:
                return
            batch = AheadBatch(buffered.popleft())
            batch.ahead = [i for j in range(self.stride - 1, window, self.stride)
                           if j < len(buffered) for i in buffered[j]]
            yield batch


class ReadAheadDataset:
    """`dataset` with the batched fetch that reads ahead (module docstring); everything else is
    the dataset's."""

    def __init__(self, dataset, remember: int = 1 << 16) -> None:
        if not callable(getattr(dataset, "sample_reads", None)):
            raise TypeError(f"{type(dataset).__name__} cannot be read ahead: it does not say "
                            "which byte ranges its samples read (sample_reads)")
        self.dataset = dataset
        self._planned: "collections.OrderedDict[int, None]" = collections.OrderedDict()
        self._remember = remember

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        return self.dataset[index]

    def __getattr__(self, name: str):
        if name == "dataset":  # unpickling: not set yet
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __getitems__(self, indices: Sequence[int]) -> list:
        # this batch's ranges first: the pool runs requests in order, and a batch not planned
        # before (the first, or after a resume) must not wait behind the batches ahead
        now = [i for i in indices if i not in self._planned]
        futures = self._prefetch(now)
        ahead = [i for i in getattr(indices, "ahead", ()) if i not in self._planned]
        self._prefetch(ahead)
        for future in futures:  # this batch's bytes, fetched concurrently
            future.exception()
        return [self.dataset[i] for i in indices]

    def _prefetch(self, indices: List[int]) -> list:
        if not indices:
            return []
        futures = []
        for remote, ranges in planned_ranges(self.dataset, indices).items():
            futures += remote.prefetch(ranges)
        for i in indices:
            self._planned[i] = None
            if len(self._planned) > self._remember:
                self._planned.popitem(last=False)
        return futures
