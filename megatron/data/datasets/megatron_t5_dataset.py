"""Megatron-style T5 samples over `PREFIX_text_sentence` data (one sequence per sentence).

For users coming from Megatron-LM's T5 (`megatron/core/datasets/t5_dataset.py`) whose data is
sentence-split. What a sample is:

1. Sentence packing. `_helpers.build_mapping` groups consecutive sentences of one document into
   rows (first sentence, one past the last, target length); the target length is the longest raw
   length that fits the encoder (`encoder_seq_length - 1`, room for EOS) or, with probability
   `short_seq_prob`, a uniform length in [2, that]. As in Megatron's T5, a row may hold a single
   sentence (min_num_sent=1), documents with a sentence over 512 tokens are skipped, and epochs are
   added until there are `num_samples` rows. The mapping is cached (`index_cache`).
2. The sentences of the row are concatenated and truncated to the target length: the raw tokens
   (`raw_tokens(i)`). A sample never crosses a document boundary and holds whole sentences (the
   last one may be cut by the truncation).
3. N-gram masking (`ngram_noise_mask`), Megatron's rule with its geometric distribution (SpanBERT):
   candidate start positions are visited in a random order; for each one an n-gram length
   n ~ Geometric(0.2) limited to `max_ngram` is drawn and shrunk while it would exceed the masking
   budget `min(masked_lm_prob * target_length, max(1, round(len * masked_lm_prob)))` tokens
   (at least 1); an n-gram that overlaps or touches an already masked span is skipped. Spans are
   token n-grams; when `tokens.word_start` (bool[vocab], SentencePiece `▁`) is given they are
   n-grams of whole words instead (so a span may then be longer than `max_ngram` tokens).
4. Corruption with `span_corruption.corrupt`: each span becomes one sentinel in the encoder input
   (`sentinel_ids[0]` = <extra_id_0> first), target = sentinel + span for each span, then EOS;
   decoder input = target shifted right after the decoder start id (`t5_dataset.make_sample`).

Differences from Megatron-LM, on purpose:
- Spans never touch: a mask is a bool array and two adjacent spans would merge into one span
  (one sentinel) longer than `max_ngram`, so an n-gram adjacent to a masked one is skipped like an
  overlapping one. Megatron lets them touch and gives each its own sentinel.
- The target must fit `decoder_seq_length`: an n-gram that would overflow it is shrunk or skipped
  (Megatron asserts instead). At Megatron's 512/128 lengths it hardly ever binds (the longest
  target over 3000 samples of random data was 112 tokens); it can when most spans are 1 token.
- `ngram_distribution="megatron"` (default) takes n = min(Geometric(0.2), max_ngram), exactly
  Megatron's draw, which puts the whole tail mass (0.8^9 = 13.4% at max_ngram=10) on max_ngram;
  "spanbert" draws from the geometric renormalised over [1, max_ngram] (mean span 3.8 as in the
  SpanBERT paper), which decreases all the way.
- At least one token is masked in every non-empty sample (Megatron masks none when the target
  length is below 1 / masked_lm_prob, i.e. in some short-target samples).
- Masked tokens are always replaced by the sentinel (no 80/10/10 BERT replacement: Megatron's T5
  does not use it either).

Sample i is a pure function of (seed, i, the dataset files): its masking generator is seeded with
(seed, i) and the mapping with seed.
"""

from __future__ import annotations

import math
import os
from typing import Dict, List, Optional, Tuple

import numpy as np

from megatron.data import _helpers
from megatron.data.storage.index_cache import cached_arrays, description_hash
from megatron.data.storage.indexed_dataset import (
    IndexedDataset,
    Read,
    default_cache_dir,
)
from megatron.data.datasets.span_corruption import corrupt
from megatron.data.datasets.t5_dataset import T5SpecialTokens, make_sample, ul2_sample
from megatron.data.datasets.ul2 import denoise

GEOMETRIC_P = 0.2          # SpanBERT / Megatron n-gram length distribution
LONG_SENTENCE_LEN = 512    # Megatron skips documents with a longer sentence
MIN_SENTENCES = 1          # Megatron's T5 allows single-sentence samples
NGRAM_DISTRIBUTIONS = ("megatron", "spanbert")


def ngram_length_probabilities(max_ngram: int, distribution: str = "megatron",
                               p: float = GEOMETRIC_P) -> np.ndarray:
    """float[max_ngram]: probability of drawing n-gram length n = 1..max_ngram (before the
    masking budget shrinks it)."""
    n = np.arange(1, max_ngram + 1)
    probs = p * (1.0 - p) ** (n - 1)
    if distribution == "megatron":  # min(Geometric(p), max_ngram): the tail lands on max_ngram
        probs[-1] = (1.0 - p) ** (max_ngram - 1)
    elif distribution == "spanbert":
        probs = probs / probs.sum()
    else:
        raise ValueError(f"ngram distribution {distribution!r} is not one of {NGRAM_DISTRIBUTIONS}")
    return probs


def _draw_lengths(count: int, max_ngram: int, distribution: str,
                  rng: np.random.Generator) -> np.ndarray:
    if distribution == "megatron":
        return np.minimum(rng.geometric(GEOMETRIC_P, size=count), max_ngram)
    probs = ngram_length_probabilities(max_ngram, distribution)
    return rng.choice(np.arange(1, max_ngram + 1), size=count, p=probs)


def ngram_noise_mask(length: int, target_length: int, masked_lm_prob: float, max_ngram: int,
                     rng: np.random.Generator, word_starts: Optional[np.ndarray] = None,
                     max_target_length: Optional[int] = None, max_spans: Optional[int] = None,
                     distribution: str = "megatron", return_spans: bool = False):
    """bool[length]: Megatron-style n-gram masking (module docstring, step 3).

    Args:
        length: raw tokens in the sample.
        target_length: the sample's target length from the mapping (enters the budget as in
            Megatron).
        masked_lm_prob: masking probability.
        max_ngram: longest n-gram, in candidates (tokens, or words with `word_starts`).
        rng: the sample's generator.
        word_starts: bool[length], True where a token begins a word; None for token n-grams.
        max_target_length: the corrupted target (sentinel + span per span, then EOS) must not
            exceed this; n-grams are shrunk or skipped so it does not.
        max_spans: at most this many spans (the number of sentinels).
        distribution: "megatron" or "spanbert" (`ngram_length_probabilities`).
        return_spans: also return the spans, [(begin, end), ...] in the order they were chosen.
    """
    mask = np.zeros(length, dtype=bool)
    chosen = []
    if length == 0:
        return (mask, chosen) if return_spans else mask
    if word_starts is None:
        starts = np.arange(length + 1)
    else:
        ws = np.asarray(word_starts, dtype=bool).copy()
        ws[0] = True
        starts = np.concatenate([np.flatnonzero(ws), [length]])
    num_candidates = len(starts) - 1  # candidate c covers tokens [starts[c], starts[c + 1])
    # Megatron's budget, but at least one token: Megatron masks nothing when the target length is
    # below 1 / masked_lm_prob (a few short-target samples), which leaves a target of EOS alone.
    # Masked counts are whole: floor() keeps the rule and lets the loop stop at the budget.
    budget = max(1, math.floor(min(masked_lm_prob * target_length,
                                   max(1, int(round(length * masked_lm_prob))))))
    order = rng.permutation(num_candidates)
    drawn = _draw_lengths(num_candidates, max_ngram, distribution, rng)
    starts = starts.tolist()
    marks = bytearray(length)  # 1 where masked (faster than numpy for the many small probes)
    masked = spans = 0
    for c, n in zip(order.tolist(), drawn.tolist()):
        if masked >= budget:
            break
        if max_spans is not None and spans >= max_spans:
            break
        allowed = budget - masked
        if max_target_length is not None:  # + one sentinel for this span + EOS
            allowed = min(allowed, max_target_length - masked - spans - 2)
        n = min(n, num_candidates - c)  # n-grams stop at the end of the sample
        begin = starts[c]
        while n > 0 and starts[c + n] - begin > allowed:
            n -= 1
        if n == 0:
            continue
        end = starts[c + n]
        # Skip n-grams that overlap or touch a masked span (touching spans would merge).
        if any(marks[max(begin - 1, 0):end + 1]):
            continue
        marks[begin:end] = b"\x01" * (end - begin)
        chosen.append((begin, end))
        masked += end - begin
        spans += 1
    mask = np.frombuffer(bytes(marks), dtype=np.uint8).astype(bool)
    return (mask, chosen) if return_spans else mask


class MegatronT5Dataset:
    """Megatron-style T5 samples from documents [doc_start, doc_end) of a sentence dataset.

    Args:
        name: for cache file names and messages (e.g. "train").
        indexed: `_text_sentence` data (one sequence per sentence).
        document_range: the documents this split uses.
        num_samples: how many samples to serve.
        encoder_seq_length, decoder_seq_length: padded lengths of encoder input and target.
        tokens: special ids; `tokens.word_start` switches to whole-word n-grams.
        masked_lm_prob: fraction of raw tokens masked (`--mask-prob`).
        short_seq_prob: probability of a shorter target length (`--short-seq-prob`).
        max_ngram: longest span, in tokens (`--max-ngram`).
        seed: the data seed (`--seed`).
        cache_dir: where the mapping cache goes (default: next to the data, `PREFIX_cache/`).
        ngram_distribution: "megatron" (default) or "spanbert" (module docstring).
        max_raw_length: the longest row, in raw tokens (default `encoder_seq_length - 1`: the
            masked input never outgrows its raw tokens + EOS; UL2 sets its own budget).
    """

    def __init__(self, name: str, indexed: IndexedDataset, document_range: Tuple[int, int],
                 num_samples: int, encoder_seq_length: int, decoder_seq_length: int,
                 tokens: T5SpecialTokens, masked_lm_prob: float = 0.15,
                 short_seq_prob: float = 0.1, max_ngram: int = 10, seed: int = 1234,
                 cache_dir: Optional[str] = None, ngram_distribution: str = "megatron",
                 cache_timeout: float = 3600.0, max_raw_length: Optional[int] = None) -> None:
        if encoder_seq_length < 3:
            raise ValueError(f"--encoder-seq-length {encoder_seq_length} is too short: a sample "
                             "needs at least 2 raw tokens and EOS")
        if decoder_seq_length < 3:
            raise ValueError(f"--decoder-seq-length {decoder_seq_length} is too short: the "
                             "target needs at least a sentinel, one token and EOS")
        if not 0.0 < masked_lm_prob < 1.0:
            raise ValueError(f"--mask-prob {masked_lm_prob} must be in (0, 1)")
        if not 0.0 <= short_seq_prob <= 1.0:
            raise ValueError(f"--short-seq-prob {short_seq_prob} must be in [0, 1]")
        if max_ngram < 1:
            raise ValueError(f"--max-ngram {max_ngram} must be >= 1")
        if ngram_distribution not in NGRAM_DISTRIBUTIONS:
            raise ValueError(f"ngram distribution {ngram_distribution!r} is not one of "
                             f"{NGRAM_DISTRIBUTIONS}")
        if num_samples < 0:
            raise ValueError(f"num_samples {num_samples} must be >= 0")
        if seed < 0:
            raise ValueError(f"--seed {seed} must be >= 0")
        if len(tokens.sentinel_ids) < 1:
            raise ValueError("the tokenizer has no sentinel ids (<extra_id_N>): set "
                             "--vocab-extra-ids")
        start, end = document_range
        if not 0 <= start <= end <= indexed.num_documents:
            raise ValueError(f"document range {document_range} outside the "
                             f"{indexed.num_documents} documents of {indexed.path_prefix}")
        self.name = name
        self.indexed = indexed
        self.document_range = (int(start), int(end))
        self.num_samples = int(num_samples)
        self.encoder_length = int(encoder_seq_length)
        self.decoder_length = int(decoder_seq_length)
        self.tokens = tokens
        self.masked_lm_prob = float(masked_lm_prob)
        self.short_seq_prob = float(short_seq_prob)
        self.max_ngram = int(max_ngram)
        self.seed = int(seed)
        self.ngram_distribution = ngram_distribution
        # Corruption never lengthens the input (a sentinel replaces >= 1 token): raw + EOS fits.
        self.max_raw_length = self.encoder_length - 1 if max_raw_length is None \
            else int(max_raw_length)
        self._sentinels = np.asarray(tokens.sentinel_ids, dtype=np.int64)

        prefix = indexed.path_prefix
        description = {
            "kind": "megatron_t5_mapping", "name": name,
            **indexed.identity(),
            "documents": [self.document_range[0], self.document_range[1]],
            "num_samples": self.num_samples, "max_seq_length": self.max_raw_length,
            "short_seq_prob": self.short_seq_prob, "seed": self.seed,
            "min_num_sent": MIN_SENTENCES, "long_sentence_len": LONG_SENTENCE_LEN,
        }
        self.cache_key = description_hash(description)
        cache_dir = default_cache_dir(prefix, cache_dir)
        arrays = cached_arrays(cache_dir, f"{os.path.basename(prefix)}_{name}_megatron_t5",
                               description, self._build_mapping, timeout=cache_timeout)
        self.mapping = arrays["mapping"]
        if self.num_samples > 0 and len(self.mapping) == 0:
            raise ValueError(
                f"{name} split of {prefix}: none of documents [{start}, {end}) can make a "
                f"sample (empty range, empty documents, or every document has a sentence longer "
                f"than {LONG_SENTENCE_LEN} tokens)")

    def _build_mapping(self) -> Dict[str, np.ndarray]:
        start, end = self.document_range
        # Copies: the index arrays are views into the mapped .idx, not always aligned.
        docs = np.array(self.indexed.document_indices[start:end + 1], dtype=np.int64)
        sizes = np.array(self.indexed.sequence_lengths, dtype=np.int32)
        if self.num_samples == 0 or end == start:
            return {"mapping": np.zeros((0, 3), dtype=np.uint64)}
        mapping = _helpers.build_mapping(docs, sizes, 2**31 - 2, self.num_samples,
                                         self.max_raw_length, self.short_seq_prob, self.seed,
                                         MIN_SENTENCES, LONG_SENTENCE_LEN)
        return {"mapping": np.asarray(mapping, dtype=np.uint64)}

    def __len__(self) -> int:
        return self.num_samples

    def sample_sentences(self, index: int) -> Tuple[int, int, int]:
        """(first sentence, one past the last, target length) of sample `index`."""
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range for {self.num_samples} samples")
        first, last, target = (int(x) for x in self.mapping[index % len(self.mapping)])
        return first, last, target

    def raw_tokens(self, index: int) -> np.ndarray:
        """int64: the raw tokens of sample `index` (its sentences, truncated), before masking."""
        first, last, target = self.sample_sentences(int(index))
        length = min(target, self.max_raw_length)
        pieces = self.indexed[first:last]
        raw = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
        return raw[:length].astype(np.int64)

    def sample_reads(self, index: int) -> List[Read]:
        """The byte ranges of data on object storage that building sample `index` reads (its
        sentences), without reading them (the read-ahead plans from them; [] for local data)."""
        first, last, _ = self.sample_sentences(int(index))
        return self.indexed.slice_reads(first, last)

    def noise_mask(self, index: int) -> np.ndarray:
        """bool: which raw tokens of sample `index` are masked."""
        raw = self.raw_tokens(index)
        return self._mask(int(index), raw)

    def _mask(self, index: int, raw: np.ndarray) -> np.ndarray:
        target = self.sample_sentences(index)[2]
        rng = np.random.default_rng([self.seed, index])
        word_starts = None
        if self.tokens.word_start is not None:
            word_starts = self.tokens.word_start[raw]
        return ngram_noise_mask(len(raw), min(target, self.max_raw_length), self.masked_lm_prob,
                                self.max_ngram, rng, word_starts=word_starts,
                                max_target_length=self.decoder_length,
                                max_spans=len(self._sentinels),
                                distribution=self.ngram_distribution)

    def __getitem__(self, index: int) -> Dict[str, np.ndarray]:
        index = int(index)
        raw = self.raw_tokens(index)
        mask = self._mask(index, raw)
        inputs, targets = corrupt(raw, mask, self._sentinels, self.tokens.eos_id)
        return make_sample(inputs, targets, self.encoder_length, self.decoder_length,
                           self.tokens.pad_id, self.tokens.decoder_start_token_id)


class MegatronUL2Dataset(MegatronT5Dataset):
    """`--t5-objective ul2 --ul2-sample-layout megatron`: the rows of whole sentences of one
    document that MegatronT5Dataset makes (module docstring, steps 1-2), each denoised by the
    UL2 denoiser its (seed, index) draws (megatron/data/datasets/ul2.py) instead of n-gram masking. Rows
    are at most the UL2 budget's raw length (`UL2Config.budget`), so every denoiser's input and
    target fit the encoder and decoder lengths; shorter rows (a document's end, `short_seq_prob`)
    make shorter samples."""

    def __init__(self, name: str, indexed: IndexedDataset, document_range: Tuple[int, int],
                 num_samples: int, config, tokens: T5SpecialTokens, short_seq_prob: float = 0.1,
                 cache_dir: Optional[str] = None, cache_timeout: float = 3600.0) -> None:
        self.ul2 = config.ul2
        raw, encoder_length, decoder_length = self.ul2.budget(config.encoder_seq_length,
                                                              config.decoder_seq_length)
        super().__init__(name, indexed, document_range, num_samples, encoder_length,
                         decoder_length, tokens, short_seq_prob=short_seq_prob, seed=config.seed,
                         cache_dir=cache_dir, cache_timeout=cache_timeout, max_raw_length=raw)

    def denoised(self, index: int):
        """(index of the denoiser drawn, encoder input, target) of sample `index`."""
        rng = np.random.default_rng([self.seed, int(index)])
        return denoise(self.raw_tokens(int(index)), self.ul2, self._sentinels,
                       self.tokens.eos_id, rng)

    def __getitem__(self, index: int) -> Dict[str, np.ndarray]:
        """ul2_sample's arrays (as UL2Dataset's)."""
        return ul2_sample(self.ul2, *self.denoised(index), self.encoder_length,
                          self.decoder_length, self.tokens)
