"""Data-parallel batch samplers, resumable from the number of samples already consumed.

The dataset already serves samples in a seeded shuffled order, so a sampler only deals out
consecutive global batches: global batch b holds samples [b * G, (b + 1) * G) with
G = micro_batch_size * data_parallel_size, and rank r takes the r-th micro-batch slice of it.
The union of the ranks' micro-batches is the DP=1 global batch, whatever the DP size; resuming
after `consumed_samples` starts at the next global batch without reading what came before.
Used as a `torch.utils.data.DataLoader(batch_sampler=...)`, with any number of workers.
"""

from __future__ import annotations

from typing import Iterator, List


class PretrainingSampler:
    """Micro-batches of sample indices for one data-parallel rank.

    Args:
        total_samples: samples in the dataset.
        consumed_samples: samples consumed (over all ranks) before this run; must be a multiple
            of micro_batch_size * data_parallel_size.
        micro_batch_size: samples per rank per micro-batch.
        data_parallel_rank, data_parallel_size: this rank's place among the data-parallel ranks.
        drop_last: drop a last incomplete global micro-batch (training); keep it for evaluation,
            where the higher ranks then get fewer samples, or no last batch at all.
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, drop_last: bool = True) -> None:
        problems = []
        if total_samples <= 0:
            problems.append(f"no samples to draw from (total_samples={total_samples})")
        if micro_batch_size <= 0:
            problems.append(f"micro batch size {micro_batch_size} must be positive")
        if data_parallel_size <= 0 or not 0 <= data_parallel_rank < data_parallel_size:
            problems.append(f"data-parallel rank {data_parallel_rank} of {data_parallel_size}")
        step = micro_batch_size * max(data_parallel_size, 1)
        if consumed_samples < 0 or (step and consumed_samples % step):
            problems.append(f"consumed samples {consumed_samples} is not a multiple of micro "
                            f"batch x data-parallel size = {step}")
        if problems:
            raise ValueError("; ".join(problems))
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.rank = data_parallel_rank
        self.size = data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        step = self.micro_batch_size * self.size
        full, rest = divmod(max(self.total_samples - self.consumed_samples, 0), step)
        return full + int(not self.drop_last and rest > self.rank * self.micro_batch_size)

    def __iter__(self) -> Iterator[List[int]]:
        step = self.micro_batch_size * self.size
        for start in range(self.consumed_samples, self.total_samples, step):
            end = min(start + step, self.total_samples)
            if end - start < step and self.drop_last:
                return
            mine = range(start + self.rank * self.micro_batch_size,
                         min(start + (self.rank + 1) * self.micro_batch_size, end))
            if mine:  # a last partial batch may leave nothing for the higher ranks
                yield list(mine)
