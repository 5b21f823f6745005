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
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from megatron.data import _helpers
from megatron.data.storage.index_cache import cached_arrays
from megatron.data.datasets.cpm2_dataset import CPM2Dataset, cpm2_prefixes, is_cpm2_prefix
from megatron.data.storage import object_storage
from megatron.data.storage.data_meta import meta_file_path, read_meta, \
    tokenizer_mismatch
from megatron.data.storage.indexed_dataset import IndexedDataset, Read, dataset_exists
from megatron.data.storage import shard_set
from megatron.data.storage.object_storage import ObjectStorage
from megatron.data.datasets.megatron_t5_dataset import MegatronT5Dataset, MegatronUL2Dataset
from megatron.data.datasets.seq2seq import Seq2SeqConfig, build_seq2seq_datasets
from megatron.data.datasets.t5_dataset import (
    T5DatasetConfig,
    T5SpanCorruptionDataset,
    T5SpecialTokens,
    UL2Dataset,
)

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


def parse_data_path(data_path: Sequence[str], storage: Optional[ObjectStorage] = None
                    ) -> Tuple[List[str], Optional[List[float]]]:
    """(prefixes, weights or None for "proportional to size"); s3:// prefixes are looked up
    through `storage` (None: the default settings).

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
    storage = storage if storage is not None else ObjectStorage()
    missing = [p for p in prefixes
               if not shard_set.exists(p, storage) and not is_cpm2_prefix(p, storage)]
    if missing:
        raise ValueError("--data-path: no .bin/.idx pair (nor a shard set's .shards.json, nor "
                         "CPM-2's _context, _target, _target_offset pairs) for "
                         + ", ".join(missing))
    return prefixes, weights


def data_file_problems(data_path: Sequence[str], impl: str = "infer",
                       storage: Optional[ObjectStorage] = None) -> List[str]:
    """Every `--data-path` dataset opened and checked as the run will open it (the index read and
    matched against its `.bin`: a truncated or foreign file is found here, not after the model is
    built; s3:// through `storage`); one message per bad prefix, naming the file. Costs one read
    of each index."""
    storage = storage if storage is not None else ObjectStorage()
    try:
        prefixes, _ = parse_data_path(data_path, storage)
    except ValueError as e:
        return [str(e)]
    except OSError as e:  # object storage: a missing bucket, refused credentials, no answer
        return [f"--data-path: {e}"]
    problems = []
    for prefix in prefixes:
        try:
            if is_cpm2_prefix(prefix, storage) and not dataset_exists(prefix, storage):
                for part in cpm2_prefixes(prefix):
                    IndexedDataset(part, impl, sequences_are_documents=True, storage=storage)
            else:
                shard_set.open_dataset(prefix, impl, storage)
        except (OSError, ValueError) as e:
            problems.append(f"--data-path {prefix}: {e}")
    return problems


def eod_problems(data_path: Sequence[str], eos_id: int, append_eod: str = "auto",
                 impl: str = "infer", storage: Optional[ObjectStorage] = None) -> List[str]:
    """For objectives that pack documents: every token dataset of `--data-path` whose EOD cannot
    be decided as `--data-append-eod` asks (data_meta.decide_eod: its sidecar contradicted, its
    sampled documents disagreeing), one message per prefix. Reads each index, each sidecar and
    a bounded sample of document ends (s3:// through `storage`); CPM-2 three-file data is left
    out (it has no EOD scan)."""
    storage = storage if storage is not None else ObjectStorage()
    try:
        prefixes, _ = parse_data_path(data_path, storage)
    except (OSError, ValueError) as e:
        return [f"--data-path: {e}"]
    problems = []
    for prefix in prefixes:
        try:
            if is_cpm2_prefix(prefix, storage) and not dataset_exists(prefix, storage):
                continue
            shard_set.open_dataset(prefix, impl, storage).eod_decision(eos_id, append_eod)
        except (OSError, ValueError) as e:
            problems.append(f"--data-path {prefix}: {e}")
    return problems


def data_kind_problems(data_path: Sequence[str], tokenizer: Optional[tuple],
                       needs_sentences: bool, impl: str = "infer",
                       storage: Optional[ObjectStorage] = None) -> List[str]:
    """For every token dataset of `--data-path` (CPM-2 three-file data left out): a sidecar
    that names another tokenizer than the run's (`tokenizer`: (the tokenizer, its type, its
    flag and path), data_meta.tokenizer_mismatch's arguments; None: not checked), and, when the
    objective reads sentences (`needs_sentences`: Megatron's rows), data with one sequence per
    document. Reads each index and sidecar."""
    storage = storage if storage is not None else ObjectStorage()
    try:
        prefixes, _ = parse_data_path(data_path, storage)
    except (OSError, ValueError):
        return []  # reported by data_file_problems
    problems = []
    for prefix in prefixes:
        try:
            if is_cpm2_prefix(prefix, storage) and not dataset_exists(prefix, storage):
                continue
            described = shard_set.sidecar_prefix(prefix, storage)  # a set's: its first shard's
            meta = read_meta(described, storage) if tokenizer is not None else None
            wrong = tokenizer_mismatch(meta, meta_file_path(described), *tokenizer) \
                if meta is not None else None
            if wrong is not None:
                problems.append(f"--data-path {prefix}: {wrong}")
            if needs_sentences:
                ds = shard_set.open_dataset(prefix, impl, storage)
                if ds.num_documents and ds.num_documents == len(ds):
                    problems.append(
                        f"--data-path {prefix}: Megatron's T5 rows (--t5-objective megatron, "
                        f"or ul2 with --ul2-sample-layout megatron) are made of sentences, "
                        f"but this data has one sequence per document ({ds.num_documents}: "
                        f"a _text_document dataset), so every row would be one document cut "
                        f"to --encoder-seq-length; preprocess with --split-sentences (a "
                        f"_text_sentence dataset), or use --t5-objective span-corruption")
        except (OSError, ValueError):
            continue  # reported by data_file_problems
    return problems


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

    def sample_reads(self, index: int) -> List[Read]:
        """Those of the part that holds sample `index` (read-ahead planning)."""
        if not 0 <= index < self.size:
            raise IndexError(f"sample {index} out of range for {self.size} samples")
        return self.datasets[int(self.dataset_index[index])].sample_reads(
            int(self.dataset_sample_index[index]))


@dataclass
class DataConfig:
    """What `build_datasets` needs besides the tokenizer.

    objective: "span-corruption" (T5's, on `_text_document` data) or "megatron" (Megatron's T5:
        geometric n-gram masking on `_text_sentence` data, with `short_seq_prob`, `max_ngram`).
        A prefix with CPM-2's three files (`P_context`, `P_target`, `P_target_offset`) is always
        read as CPM-2 data.
    """

    data_path: Sequence[str]
    split: str = "969,30,1"
    data_impl: str = "infer"
    data_cache_path: Optional[str] = None
    cache_timeout: float = 3600.0
    t5: T5DatasetConfig = T5DatasetConfig()
    objective: str = "span-corruption"
    short_seq_prob: float = 0.1
    max_ngram: int = 10
    ul2_layout: str = "packed"
    """--t5-objective ul2: "packed" (span corruption's windows over `_text_document` data) or
    "megatron" (Megatron's rows of whole sentences of one document, `_text_sentence` data;
    `short_seq_prob` applies)."""
    append_eod: str = "auto"
    """--data-append-eod: whether the documents of every prefix end with EOD ("yes", "no"), or
    "auto": each prefix's sidecar, checked against a bounded sample of its document ends, or
    that sample alone (megatron/data/storage/data_meta.py). Read by the objectives that pack documents
    (span corruption, UL2's packed layout)."""
    seq2seq: Optional[Seq2SeqConfig] = None
    """objective "seq2seq" (fine-tuning, `--finetune-data`): the pairs it reads instead of
    `data_path` (megatron/data/datasets/seq2seq.py)."""

    def packs_documents(self) -> bool:
        """Whether the objective packs documents back to back (and so needs EOD between)."""
        return self.objective == "span-corruption" or (
            self.objective == "ul2" and self.ul2_layout == "packed")


class _Source:
    """One --data-path entry: a token dataset, or CPM-2's three files."""

    def __init__(self, prefix: str, impl: str, storage: ObjectStorage) -> None:
        self.prefix, self.storage = prefix, storage
        self.cpm2 = is_cpm2_prefix(prefix, storage) and not dataset_exists(prefix, storage)
        opened = IndexedDataset(cpm2_prefixes(prefix)[0], impl, sequences_are_documents=True,
                                storage=storage) \
            if self.cpm2 else shard_set.open_dataset(prefix, impl, storage)
        self.num_documents = opened.num_documents
        self.num_tokens = opened.num_tokens
        self.indexed = None if self.cpm2 else opened

    def make(self, name: str, documents: Tuple[int, int], num_samples: int, config: DataConfig,
             tokens: T5SpecialTokens, cache_dir: Optional[str]):
        """The `name` split's dataset: CPM-2's own samples for CPM-2 data, else the objective's
        (`OBJECTIVES`)."""
        t5 = config.t5
        if self.cpm2:
            if t5.decoder_seq_length is None:
                raise ValueError(f"CPM-2 data ({self.prefix}) needs --decoder-seq-length")
            return CPM2Dataset(self.prefix, documents, num_samples, t5.encoder_seq_length,
                               t5.decoder_seq_length, tokens, seed=t5.seed, name=name,
                               impl=config.data_impl, cache_dir=cache_dir,
                               cache_timeout=config.cache_timeout, storage=self.storage)
        return OBJECTIVES[config.objective](name, self.indexed, documents, num_samples, config,
                                            tokens, cache_dir)


def _span_corruption(name: str, indexed: IndexedDataset, documents: Tuple[int, int],
                     num_samples: int, config: DataConfig, tokens: T5SpecialTokens,
                     cache_dir: str) -> T5SpanCorruptionDataset:
    return T5SpanCorruptionDataset(name, indexed, documents, num_samples, config.t5, tokens,
                                   cache_dir, config.cache_timeout, config.append_eod)


def _megatron(name: str, indexed: IndexedDataset, documents: Tuple[int, int],
              num_samples: int, config: DataConfig, tokens: T5SpecialTokens,
              cache_dir: str) -> MegatronT5Dataset:
    t5 = config.t5
    if t5.decoder_seq_length is None:
        raise ValueError(f"--t5-objective megatron ({indexed.path_prefix}) needs "
                         f"--decoder-seq-length")
    return MegatronT5Dataset(name, indexed, documents, num_samples, t5.encoder_seq_length,
                             t5.decoder_seq_length, tokens, masked_lm_prob=t5.noise_density,
                             short_seq_prob=config.short_seq_prob, max_ngram=config.max_ngram,
                             seed=t5.seed, cache_dir=cache_dir,
                             cache_timeout=config.cache_timeout)


def _ul2(name: str, indexed: IndexedDataset, documents: Tuple[int, int], num_samples: int,
         config: DataConfig, tokens: T5SpecialTokens, cache_dir: str) -> UL2Dataset:
    if config.t5.ul2 is None:
        raise ValueError("--t5-objective ul2 needs its denoisers (T5DatasetConfig.ul2)")
    if config.ul2_layout == "megatron":
        return MegatronUL2Dataset(name, indexed, documents, num_samples, config.t5, tokens,
                                  short_seq_prob=config.short_seq_prob, cache_dir=cache_dir,
                                  cache_timeout=config.cache_timeout)
    if config.ul2_layout != "packed":
        raise ValueError(f"--ul2-sample-layout {config.ul2_layout!r}: choose packed or megatron")
    return UL2Dataset(name, indexed, documents, num_samples, config.t5, tokens, cache_dir,
                      config.cache_timeout, config.append_eod)


def _seq2seq(name: str, indexed: IndexedDataset, *rest) -> None:
    raise ValueError(f"--t5-objective seq2seq reads --finetune-data, not --data-path "
                     f"({indexed.path_prefix})")


OBJECTIVES: Dict[str, Callable[..., object]] = {
    "span-corruption": _span_corruption,
    "megatron": _megatron,
    "ul2": _ul2,
    "seq2seq": _seq2seq,  # built from DataConfig.seq2seq by build_datasets
}
"""--t5-objective: the dataset of a split of a token dataset, by objective (a new objective is
one entry here): f(split name, IndexedDataset, (first, end) documents, samples, DataConfig,
T5SpecialTokens, the --data-cache-path folder or None: the dataset puts its caches in
indexed_dataset.default_cache_dir of that)."""


def build_datasets(config: DataConfig, tokens: T5SpecialTokens,
                   num_samples: Tuple[int, int, int],
                   storage: Optional[ObjectStorage] = None) -> Dict[str, Optional[object]]:
    """{"train"|"valid"|"test": dataset or None (an empty split or no samples asked)}; s3://
    prefixes are read through `storage` (None: ObjectStorage() with the default settings)."""
    if config.objective not in OBJECTIVES:
        raise ValueError(f"--t5-objective {config.objective!r}: choose one of "
                         f"{', '.join(OBJECTIVES)}")
    if config.objective == "seq2seq":
        if config.seq2seq is None:
            raise ValueError("--t5-objective seq2seq needs --finetune-data")
        t5 = config.t5
        return build_seq2seq_datasets(config.seq2seq, t5.encoder_seq_length,
                                      t5.decoder_seq_length, t5.seed, tokens, num_samples)
    storage = storage if storage is not None else ObjectStorage()
    prefixes, weights = parse_data_path(config.data_path, storage)
    sources = [_Source(p, config.data_impl, storage) for p in prefixes]
    if weights is None:
        weights = [float(d.num_tokens) for d in sources]
    total_weight = sum(weights)
    weights = [w / total_weight for w in weights]
    out: Dict[str, Optional[object]] = {}
    for s, name in enumerate(SPLIT_NAMES):
        if num_samples[s] <= 0:
            out[name] = None
            continue
        parts, part_weights = [], []
        for d, w in zip(sources, weights):
            start, end = parse_split(config.split, d.num_documents)[s]
            if end <= start or w == 0:
                continue
            share = num_samples[s] if len(sources) == 1 else int(np.ceil(num_samples[s] * w * 1.005))
            # The dataset applies default_cache_dir itself: applied here too, an s3:// prefix's
            # folder was nested in itself.
            parts.append(d.make(name, (start, end), share, config, tokens,
                                config.data_cache_path))
            part_weights.append(w)
        if not parts:
            out[name] = None
        elif len(parts) == 1:
            out[name] = parts[0]
        else:
            cache_dir = config.data_cache_path or (
                os.path.join(object_storage.default_cache_path(), "blend_cache")
                if object_storage.is_remote(prefixes[0])
                else os.path.join(os.path.dirname(os.path.abspath(prefixes[0])), "blend_cache"))
            out[name] = BlendedDataset(name, parts, part_weights, num_samples[s], cache_dir,
                                       config.cache_timeout)
    return out
