"""From `--data-path`, `--split` and the schedule to train / valid / test datasets.

- `--data-path PREFIX`, `--data-path W1 P1 W2 P2 ...` (weights need not sum to 1) or
  `--data-path P1 P2 ...` (weights proportional to each dataset's token count).
- `--split 950,30,20` (or `/`-separated): contiguous document ranges, Megatron's rounding.
- Sample counts from the schedule, as Megatron computes them: train = iters x global batch;
  valid = (iters // eval_interval + 1) x eval_iters x global batch; test = eval_iters x global batch.
- Several datasets are blended by `BlendedDataset` in exact proportion; each part is asked for
  0.5% more samples than its share so that rounding never runs it dry.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from megatron.data import _helpers
from megatron.data.index_cache import cached_arrays
from megatron.data.indexed_dataset import IndexedDataset, dataset_exists, index_file_path
from megatron.data.t5_dataset import T5DatasetConfig, T5SpanCorruptionDataset, T5SpecialTokens

SPLIT_NAMES = ("train", "valid", "test")


def parse_split(split: str, num_documents: int) -> List[Tuple[int, int]]:
    """Document ranges of train, valid and test for `--split` (e.g. "950,30,20" or "98/2/0").

    Raises:
        ValueError: the string is not 1-3 non-negative numbers with a positive sum.
    """
    text = split.replace("/", ",")
    try:
        weights = [float(x) for x in text.split(",") if x.strip() != ""]
    except ValueError:
        raise ValueError(f"--split {split!r}: expected up to 3 numbers like 950,30,20") from None
    if not 1 <= len(weights) <= 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"--split {split!r}: expected up to 3 non-negative numbers with a "
                         "positive sum, like 950,30,20")
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w / total * num_documents)))
    excess = bounds[-1] - num_documents
    bounds = [bounds[0]] + [b - excess for b in bounds[1:]]
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


def split_sample_counts(train_iters: int, global_batch_size: int, eval_interval: int,
                        eval_iters: int) -> Tuple[int, int, int]:
    """(train, valid, test) samples the schedule consumes (Megatron's formula)."""
    evaluations = train_iters // eval_interval + 1 if eval_interval > 0 else 1
    return (train_iters * global_batch_size, evaluations * eval_iters * global_batch_size,
            eval_iters * global_batch_size)


def parse_data_path(data_path: Sequence[str]) -> Tuple[List[str], Optional[List[float]]]:
    """(prefixes, weights or None for "proportional to size").

    Raises:
        ValueError: a malformed weighted list, or a prefix without its .bin/.idx.
    """
    items = list(data_path)
    if not items:
        raise ValueError("--data-path is empty")

    def is_number(s: str) -> bool:
        try:
            float(s)
            return True
        except ValueError:
            return False

    if len(items) > 1 and is_number(items[0]):
        if len(items) % 2 or not all(is_number(w) for w in items[0::2]):
            raise ValueError("--data-path with weights must be W1 PREFIX1 W2 PREFIX2 ...: "
                             f"got {' '.join(items)}")
        weights = [float(w) for w in items[0::2]]
        prefixes = items[1::2]
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(f"--data-path weights {weights} must be >= 0 with a positive sum")
    else:
        prefixes, weights = items, None
    missing = [p for p in prefixes if not dataset_exists(p)]
    if missing:
        raise ValueError("--data-path: no .bin/.idx pair for " + ", ".join(missing))
    return prefixes, weights


class BlendedDataset:
    """Samples of several datasets interleaved in exact proportion to `weights`."""

    def __init__(self, name: str, datasets: Sequence, weights: Sequence[float], size: int,
                 cache_dir: str, cache_timeout: float = 3600.0) -> None:
        self.datasets = list(datasets)
        self.size = size
        weights = np.asarray(weights, dtype=np.float64)
        description = {"kind": "blend", "name": name, "weights": weights.tolist(), "size": size,
                       "parts": [getattr(d, "cache_key", repr(d)) for d in self.datasets]}
        arrays = cached_arrays(cache_dir, f"blend_{name}", description,
                               lambda: dict(zip(("dataset_index", "dataset_sample_index"),
                                                _helpers.build_blending_indices(weights, size))),
                               timeout=cache_timeout)
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]
        # Each part serves its samples 0, 1, 2, ... in turn, so it needs as many as it is chosen.
        needed = np.bincount(self.dataset_index, minlength=len(self.datasets))
        for k, d in enumerate(self.datasets):
            if needed[k] > len(d):
                raise ValueError(f"blend {name}: dataset {k} has {len(d)} samples, fewer than "
                                 f"the {needed[k]} its weight asks for")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int):
        if not 0 <= index < self.size:
            raise IndexError(f"sample {index} out of range for {self.size} samples")
        return self.datasets[int(self.dataset_index[index])][
            int(self.dataset_sample_index[index])]


@dataclass
class DataConfig:
    """What `build_datasets` needs besides the tokenizer."""

    data_path: Sequence[str]
    split: str = "969,30,1"
    data_impl: str = "infer"
    data_cache_path: Optional[str] = None
    cache_timeout: float = 3600.0
    t5: T5DatasetConfig = T5DatasetConfig()


def build_datasets(config: DataConfig, tokens: T5SpecialTokens,
                   num_samples: Tuple[int, int, int]) -> Dict[str, Optional[object]]:
    """{"train"|"valid"|"test": dataset or None (an empty split or no samples asked)}."""
    prefixes, weights = parse_data_path(config.data_path)
    indexed = [IndexedDataset(p, impl=config.data_impl) for p in prefixes]
    if weights is None:
        weights = [float(d.num_tokens) for d in indexed]
    total_weight = sum(weights)
    weights = [w / total_weight for w in weights]
    out: Dict[str, Optional[object]] = {}
    for s, name in enumerate(SPLIT_NAMES):
        if num_samples[s] <= 0:
            out[name] = None
            continue
        parts, part_weights = [], []
        for d, w in zip(indexed, weights):
            start, end = parse_split(config.split, d.num_documents)[s]
            if end <= start or w == 0:
                continue
            share = num_samples[s] if len(indexed) == 1 else int(np.ceil(num_samples[s] * w * 1.005))
            cache_dir = config.data_cache_path or f"{d.path_prefix}_cache"
            parts.append(T5SpanCorruptionDataset(name, d, (start, end), share, config.t5, tokens,
                                                 cache_dir, config.cache_timeout))
            part_weights.append(w)
        if not parts:
            out[name] = None
        elif len(parts) == 1:
            out[name] = parts[0]
        else:
            cache_dir = config.data_cache_path or os.path.dirname(
                os.path.abspath(index_file_path(prefixes[0])))
            out[name] = BlendedDataset(name, parts, part_weights, num_samples[s],
                                       os.path.join(cache_dir, "blend_cache")
                                       if not config.data_cache_path else cache_dir,
                                       config.cache_timeout)
    return out
