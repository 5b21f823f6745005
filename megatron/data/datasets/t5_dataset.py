"""The T5 span-corruption dataset over a `PREFIX_text_document` dataset.

Raw tokens are packed back to back from consecutive documents (in a seeded per-epoch shuffled
order) with EOS between documents, so no sample is padded; every sample takes exactly the raw
length that fills the encoder after corruption (`span_corruption.expected_lengths`). Three index
arrays, built once and cached (`index_cache`), make any sample reachable in O(1):

    doc_idx     int64[epochs * documents]  document order, one shuffled permutation per epoch
    sample_idx  int64[samples + 1, 2]      (position in doc_idx, token offset) where a sample starts
    shuffle_idx int64[samples]             the order in which samples are served

Sample i is a pure function of (seed, i, the dataset files): its noise mask comes from a generator
seeded with (seed, i), so any rank or loader worker makes the same sample.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from megatron.data import _helpers
from megatron.data.storage.index_cache import cached_arrays, description_hash
from megatron.data.datasets.ul2 import KINDS, UL2Config, denoise
from megatron.data.storage.indexed_dataset import (
    IndexedDataset,
    Read,
    default_cache_dir,
)
from megatron.data.datasets.span_corruption import (
    corrupt,
    expected_lengths,
    random_spans_noise_mask,
    whole_word_noise_mask,
)

IGNORE_INDEX = -100


@dataclass(frozen=True)
class T5SpecialTokens:
    """The ids the dataset needs from the tokenizer (see `from_tokenizer`)."""

    pad_id: int
    eos_id: int
    decoder_start_token_id: int
    sentinel_ids: Tuple[int, ...]
    word_start: Optional[np.ndarray] = None  # bool[vocab]: the piece starts a word

    @classmethod
    def from_tokenizer(cls, tokenizer, whole_word: bool = False) -> "T5SpecialTokens":
        """The ids of either tokenizer type (megatron.data.tokenizers.tokenizer.build_tokenizer): T5's
        pad, eos, pad as decoder start and <extra_id_N>; CPM-2's <pad>, <eod>, <s> and <s_N>.
        Word starts: SentencePiece's "▁" pieces, CPM-2's pieces that are no "##" continuation."""
        word_start = tokenizer.word_start_mask() if whole_word else None
        return cls(tokenizer.pad_id, tokenizer.eos_id, tokenizer.decoder_start_token_id,
                   tuple(tokenizer.sentinel_ids), word_start)


@dataclass(frozen=True)
class T5DatasetConfig:
    """How samples are made.

    encoder_seq_length: encoder tokens per sample (`--encoder-seq-length`, `--seq-length`).
    decoder_seq_length: decoder tokens per sample; None takes the target length that span
        corruption gives (114 for 512 at the defaults).
    noise_density: fraction of raw tokens corrupted (`--noise-density`, `--mask-prob`).
    mean_noise_span_length: mean corrupted span length in tokens (`--mean-noise-span-length`).
    whole_word: spans never split a SentencePiece word (`--whole-word-masking`).
    seed: the data seed (`--seed`).
    """

    encoder_seq_length: int = 512
    decoder_seq_length: Optional[int] = None
    noise_density: float = 0.15
    mean_noise_span_length: float = 3.0
    whole_word: bool = False
    seed: int = 1234
    ul2: Optional["UL2Config"] = None
    """`--t5-objective ul2`: the mixture of denoisers (megatron/data/datasets/ul2.py), which sets the
    lengths."""

    def lengths(self) -> Tuple[int, int, int]:
        """(raw tokens per sample, encoder length, decoder length)."""
        if self.ul2 is not None:
            return self.ul2.budget(self.encoder_seq_length, self.decoder_seq_length)
        raw, target = expected_lengths(self.encoder_seq_length, self.noise_density,
                                       self.mean_noise_span_length)
        decoder = self.decoder_seq_length if self.decoder_seq_length is not None else target
        if decoder < target:
            raise ValueError(
                f"--decoder-seq-length {decoder} is shorter than the {target} target tokens that "
                f"span corruption of {self.encoder_seq_length} encoder tokens gives (noise density "
                f"{self.noise_density}, mean span {self.mean_noise_span_length})")
        return raw, self.encoder_seq_length, decoder


def document_token_counts(ds: IndexedDataset) -> np.ndarray:
    """int64[documents]: tokens of each document (all its sequences)."""
    lengths = np.asarray(ds.sequence_lengths, dtype=np.int64)
    bounds = np.asarray(ds.document_indices, dtype=np.int64)
    cumulative = np.concatenate([[0], np.cumsum(lengths)])
    return cumulative[bounds[1:]] - cumulative[bounds[:-1]]


class T5SpanCorruptionDataset:
    """Span-corruption samples from documents [doc_start, doc_end) of a document dataset.

    Args:
        name: for cache file names and messages (e.g. "train").
        indexed: the tokens.
        document_range: the documents this split uses.
        num_samples: how many samples to serve; epochs are added until there are enough.
        config: lengths, noise, seed.
        tokens: special ids.
        cache_dir: `--data-cache-path` (None: `PREFIX_cache/` beside local data, a node-local
            folder for s3:// data; indexed_dataset.default_cache_dir).
        append_eod: `--data-append-eod`: whether documents end with EOD ("yes", "no", or
            "auto": the dataset's sidecar checked against, or else decided by, a bounded sample
            of document ends; megatron/data/storage/data_meta.py). Raises DataMetaError (a ValueError)
            when "auto" cannot tell.
    """

    def __init__(self, name: str, indexed: IndexedDataset, document_range: Tuple[int, int],
                 num_samples: int, config: T5DatasetConfig, tokens: T5SpecialTokens,
                 cache_dir: Optional[str] = None, cache_timeout: float = 3600.0,
                 append_eod: str = "auto") -> None:
        self.name = name
        self.indexed = indexed
        self.config = config
        self.tokens = tokens
        self.raw_length, self.encoder_length, self.decoder_length = config.lengths()
        self._sentinels = np.asarray(tokens.sentinel_ids, dtype=np.int64)
        start, end = document_range
        if not 0 <= start <= end <= indexed.num_documents:
            raise ValueError(f"document range {document_range} outside the "
                             f"{indexed.num_documents} documents of {indexed.path_prefix}")
        self.document_range = (start, end)
        counts = document_token_counts(indexed)[start:end]
        # Documents that do not end with EOS get one, virtually, so that packed documents are
        # always separated. Decided without scanning the data (data_meta.decide_eod), once per
        # IndexedDataset.
        self.eod = indexed.eod_decision(tokens.eos_id, append_eod)
        self._needs_eos = self.eod.needs_eos(indexed)[start:end]
        self._doc_sizes = counts + self._needs_eos
        tokens_per_epoch = int(self._doc_sizes.sum())
        if tokens_per_epoch < self.raw_length:
            raise ValueError(
                f"{name} split of {indexed.path_prefix}: {end - start} documents hold "
                f"{tokens_per_epoch} tokens, fewer than one sample ({self.raw_length} raw tokens)")
        num_epochs = max(1, -(-num_samples * self.raw_length // tokens_per_epoch))
        description = {
            "kind": "t5_span_corruption", "name": name,
            **indexed.identity(),
            "documents": [start, end], "num_samples": num_samples, "num_epochs": num_epochs,
            "raw_length": self.raw_length, "seed": config.seed,
            "eod_appended": self.eod.appended,
        }
        self.cache_key = description_hash(description)  # names this dataset in blend caches
        cache_dir = default_cache_dir(indexed.path_prefix, cache_dir)
        arrays = cached_arrays(cache_dir, f"{os.path.basename(indexed.path_prefix)}_{name}",
                               description, lambda: self._build(num_epochs, tokens_per_epoch),
                               timeout=cache_timeout)
        self.doc_idx = arrays["doc_idx"]
        self.sample_idx = arrays["sample_idx"]
        self.shuffle_idx = arrays["shuffle_idx"]
        self.num_samples = num_samples

    def _build(self, num_epochs: int, tokens_per_epoch: int) -> Dict[str, np.ndarray]:
        num_docs = len(self._doc_sizes)
        rng = np.random.default_rng([self.config.seed, 0x7D0C])
        doc_idx = np.concatenate([rng.permutation(num_docs) for _ in range(num_epochs)])
        sample_idx = _helpers.build_sample_idx(
            self._doc_sizes.astype(np.int32), doc_idx.astype(np.int64), self.raw_length,
            num_epochs, tokens_per_epoch, True, False)
        shuffle_idx = np.random.default_rng([self.config.seed, 0x5A3F]).permutation(
            len(sample_idx) - 1).astype(np.int64)
        return {"doc_idx": doc_idx.astype(np.int64), "sample_idx": sample_idx,
                "shuffle_idx": shuffle_idx}

    def __len__(self) -> int:
        return self.num_samples

    def _document_tokens(self, local_doc: int, begin: int, end: int) -> np.ndarray:
        """Tokens [begin, end) of a document, the virtual EOS included."""
        doc = self.document_range[0] + local_doc
        first, last = (int(x) for x in self.indexed.document_indices[doc:doc + 2])
        if last - first == 1:  # read [begin, end) only (data on object storage: those bytes)
            size = int(self.indexed.sequence_lengths[first])
            stored = self.indexed.get(first, min(begin, size), max(0, min(end, size) - begin))
            if self._needs_eos[local_doc] and end > size:
                stored = np.concatenate([stored, np.asarray([self.tokens.eos_id], stored.dtype)])
            return stored
        else:
            stored = np.concatenate(self.indexed[first:last]) if last > first else \
                np.zeros(0, dtype=self.indexed.dtype)
        if self._needs_eos[local_doc]:
            stored = np.concatenate([stored, np.asarray([self.tokens.eos_id], stored.dtype)])
        return stored[begin:end]

    def _document_reads(self, local_doc: int, begin: int, end: int) -> List[Read]:
        """What _document_tokens(local_doc, begin, end) reads of data on object storage."""
        doc = self.document_range[0] + local_doc
        first, last = (int(x) for x in self.indexed.document_indices[doc:doc + 2])
        if last - first == 1:
            size = int(self.indexed.sequence_lengths[first])
            return self.indexed.reads(first, min(begin, size), max(0, min(end, size) - begin))
        return self.indexed.slice_reads(first, last)

    def _sample_window(self, index: int) -> int:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range for {self.num_samples} samples")
        return int(self.shuffle_idx[index])

    def raw_tokens(self, index: int) -> np.ndarray:
        """The packed raw tokens of sample `index` (before corruption)."""
        return self.packed_tokens(self._sample_window(index))

    def sample_reads(self, index: int) -> List[Read]:
        """The byte ranges of data on object storage that building sample `index` reads, in
        order, without reading them (the read-ahead plans from them; [] for local data)."""
        return [r for doc, begin, end in self._window_pieces(self._sample_window(index))
                for r in self._document_reads(doc, begin, end)]

    def _window_pieces(self, j: int) -> List[Tuple[int, int, int]]:
        """(document in the split, begin, end) token slices of packed window j, in order."""
        (p0, o0), (p1, o1) = self.sample_idx[j], self.sample_idx[j + 1]
        pieces = []
        for p in range(int(p0), int(p1) + 1):
            doc = int(self.doc_idx[p])
            begin = int(o0) if p == p0 else 0
            end = int(o1) if p == p1 else int(self._doc_sizes[doc])
            if end > begin:
                pieces.append((doc, begin, end))
        return pieces

    def packed_tokens(self, j: int) -> np.ndarray:
        """Window j of the packed token stream (samples in packing order, before shuffling)."""
        raw = np.concatenate([self._document_tokens(*piece)
                              for piece in self._window_pieces(j)]).astype(np.int64)
        if len(raw) != self.raw_length:  # only a corrupt cache could do this
            raise ValueError(f"{self.name}: packed sample {j} has {len(raw)} tokens, expected "
                             f"{self.raw_length}; delete the index cache and retry")
        return raw

    def __getitem__(self, index: int) -> Dict[str, np.ndarray]:
        raw = self.raw_tokens(int(index))
        rng = np.random.default_rng([self.config.seed, int(index)])
        cfg = self.config
        if cfg.whole_word and self.tokens.word_start is not None:
            mask = whole_word_noise_mask(self.tokens.word_start[raw], cfg.noise_density,
                                         cfg.mean_noise_span_length, rng)
            inputs, targets = corrupt(raw, mask, self._sentinels, self.tokens.eos_id)
            if len(inputs) > self.encoder_length or len(targets) > self.decoder_length:
                mask = None  # this draw does not fit: fall back to token spans
        else:
            mask = None
        if mask is None:
            mask = random_spans_noise_mask(len(raw), cfg.noise_density,
                                           cfg.mean_noise_span_length, rng)
            inputs, targets = corrupt(raw, mask, self._sentinels, self.tokens.eos_id)
        return make_sample(inputs, targets, self.encoder_length, self.decoder_length,
                           self.tokens.pad_id, self.tokens.decoder_start_token_id)


class UL2Dataset(T5SpanCorruptionDataset):
    """`--t5-objective ul2`: the packed windows of T5SpanCorruptionDataset, each denoised by the
    denoiser its (seed, index) draws (megatron/data/datasets/ul2.py); `config.ul2` is set."""

    def denoised(self, index: int):
        """(index of the denoiser drawn, encoder input, target) of sample `index`."""
        raw = self.raw_tokens(int(index))
        rng = np.random.default_rng([self.config.seed, int(index)])
        return denoise(raw, self.config.ul2, self._sentinels, self.tokens.eos_id, rng)

    def __getitem__(self, index: int) -> Dict[str, np.ndarray]:
        """ul2_sample's arrays."""
        return ul2_sample(self.config.ul2, *self.denoised(index), self.encoder_length,
                          self.decoder_length, self.tokens)


def ul2_sample(ul2: UL2Config, which: int, inputs: np.ndarray, targets: np.ndarray,
               encoder_length: int, decoder_length: int,
               tokens: T5SpecialTokens) -> Dict[str, np.ndarray]:
    """make_sample's arrays of a UL2 sample, and `denoiser_kind`: the index in ul2.KINDS of the
    kind of denoiser `which` (R 0, S 1, X 2), from which the step reports the loss per kind."""
    sample = make_sample(inputs, targets, encoder_length, decoder_length, tokens.pad_id,
                         tokens.decoder_start_token_id)
    sample["denoiser_kind"] = np.array(KINDS.index(ul2.denoisers[which].kind), dtype=np.int64)
    return sample


def make_sample(inputs: np.ndarray, targets: np.ndarray, encoder_length: int,
                decoder_length: int, pad_id: int, decoder_start_id: int) -> Dict[str, np.ndarray]:
    """Fixed-shape int64 arrays of one sample; labels are -100 where there is no target."""
    if len(inputs) > encoder_length or len(targets) > decoder_length:
        raise ValueError(f"sample of {len(inputs)} input / {len(targets)} target tokens does not "
                         f"fit {encoder_length} / {decoder_length}")
    enc = np.full(encoder_length, pad_id, dtype=np.int64)
    enc[:len(inputs)] = inputs
    labels = np.full(decoder_length, IGNORE_INDEX, dtype=np.int64)
    labels[:len(targets)] = targets
    dec = np.full(decoder_length, pad_id, dtype=np.int64)
    dec[0] = decoder_start_id
    dec[1:len(targets)] = targets[:-1]  # shift right
    enc_mask = np.zeros(encoder_length, dtype=np.int64)
    enc_mask[:len(inputs)] = 1
    dec_mask = np.zeros(decoder_length, dtype=np.int64)
    dec_mask[:len(targets)] = 1
    return {"encoder_input_ids": enc, "decoder_input_ids": dec, "labels": labels,
            "encoder_attention_mask": enc_mask, "decoder_attention_mask": dec_mask}


def collate(samples: Sequence[Dict[str, np.ndarray]]) -> Dict[str, np.ndarray]:
    """Stack samples into a batch: each key becomes [batch, length]."""
    return {key: np.stack([s[key] for s in samples]) for key in samples[0]}
