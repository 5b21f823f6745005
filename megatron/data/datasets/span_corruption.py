"""T5's span-corruption objective on token ids (the T5 paper, section 3.1.4; t5x/seqio semantics).

A raw window of tokens is split into alternating non-noise and noise spans at random; each noise
span is replaced in the encoder input by one sentinel (`<extra_id_0>` first, then counting down in
id as Hugging Face's T5 does), and the target lists each sentinel followed by the span it replaced,
then EOS:

    raw      a b c d e f g h
    mask     . . x x . . . x
    input    a b <0> e f g <1> EOS
    target   <0> c d <1> h EOS

`expected_lengths` chooses the raw length so that the corrupted input fills the encoder exactly
(encoder 512, density 0.15, mean span 3 -> 568 raw tokens and 114 target tokens).
Pure numpy; the caller passes a seeded `numpy.random.Generator`, so a sample is a pure function
of its seed.
"""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np


def _lengths_after_corruption(raw_length: int, noise_density: float,
                              mean_noise_span_length: float) -> Tuple[int, int]:
    """(input length, target length), EOS included, for `raw_length` raw tokens."""
    noise = int(round(raw_length * noise_density))
    spans = int(round(noise / mean_noise_span_length))
    return raw_length - noise + spans + 1, noise + spans + 1


def expected_lengths(encoder_length: int, noise_density: float = 0.15,
                     mean_noise_span_length: float = 3.0) -> Tuple[int, int]:
    """(raw tokens per sample, target length) that fill an encoder of `encoder_length` exactly.

    The largest raw length whose corrupted input fits, as T5's `random_spans_helper` chooses it.

    Raises:
        ValueError: the arguments cannot make a sample (non-positive lengths, density not in
            (0, 1), mean span below 1).
    """
    if encoder_length < 2:
        raise ValueError(f"encoder length {encoder_length} is too short for span corruption")
    if not 0.0 < noise_density < 1.0:
        raise ValueError(f"noise density {noise_density} must be in (0, 1)")
    if mean_noise_span_length < 1.0:
        raise ValueError(f"mean noise span length {mean_noise_span_length} must be >= 1")
    raw = encoder_length - 1
    while _lengths_after_corruption(raw + 1, noise_density, mean_noise_span_length)[0] \
            <= encoder_length:
        raw += 1
    return raw, _lengths_after_corruption(raw, noise_density, mean_noise_span_length)[1]


def _random_segmentation(num_items: int, num_segments: int, rng: np.random.Generator) -> np.ndarray:
    """Lengths of `num_segments` non-empty segments of `num_items` items, uniformly at random."""
    # Choose num_segments - 1 distinct cut points among the num_items - 1 gaps.
    cuts = np.sort(rng.choice(num_items - 1, size=num_segments - 1, replace=False)) + 1
    bounds = np.concatenate([[0], cuts, [num_items]])
    return np.diff(bounds)


def random_spans_noise_mask(length: int, noise_density: float, mean_noise_span_length: float,
                            rng: np.random.Generator) -> np.ndarray:
    """bool[length]: which tokens are noise. Noise and non-noise spans alternate, starting with
    non-noise; there are round(noise / mean span) noise spans (at least 1) and
    round(length * density) noise tokens (at least 1, at most length - 1)."""
    if length < 2:
        raise ValueError(f"cannot corrupt {length} tokens: at least 2 are needed")
    num_noise = min(max(int(round(length * noise_density)), 1), length - 1)
    num_spans = max(int(round(num_noise / mean_noise_span_length)), 1)
    num_nonnoise = length - num_noise
    num_spans = min(num_spans, num_noise, num_nonnoise)
    noise_lengths = _random_segmentation(num_noise, num_spans, rng)
    nonnoise_lengths = _random_segmentation(num_nonnoise, num_spans, rng)
    interleaved = np.stack([nonnoise_lengths, noise_lengths], axis=1).reshape(-1)
    # Spans alternate non-noise (even span number) and noise (odd span number).
    span_starts = np.zeros(length, dtype=np.int64)
    span_starts[np.cumsum(interleaved)[:-1]] = 1
    return (np.cumsum(span_starts) % 2) == 1


def whole_word_noise_mask(word_starts: np.ndarray, noise_density: float,
                          mean_noise_span_length: float, rng: np.random.Generator) -> np.ndarray:
    """Like `random_spans_noise_mask`, but spans cover whole words: the segmentation is drawn over
    words (`word_starts[i]` is True where token i begins a word, SentencePiece's `▁`), so no span
    starts or ends inside a word. Lengths are in words; the token noise fraction follows."""
    word_starts = np.asarray(word_starts, dtype=bool).copy()
    word_starts[0] = True
    word_ids = np.cumsum(word_starts) - 1  # word of each token
    num_words = int(word_ids[-1]) + 1
    if num_words < 2:
        return random_spans_noise_mask(len(word_starts), noise_density, mean_noise_span_length,
                                       rng)
    tokens_per_word = len(word_starts) / num_words
    word_mask = random_spans_noise_mask(num_words, noise_density,
                                        max(1.0, mean_noise_span_length / tokens_per_word), rng)
    return word_mask[word_ids]


def corrupt(tokens: np.ndarray, mask: np.ndarray, sentinel_ids: np.ndarray, eos_id: int,
            input_length: Optional[int] = None) -> Tuple[np.ndarray, np.ndarray]:
    """(encoder input, target) for raw `tokens` and noise `mask` (module docstring).

    `sentinel_ids[i]` is the id of `<extra_id_i>`. Both outputs end with `eos_id`.

    Raises:
        ValueError: more noise spans than sentinels, or the input would exceed `input_length`.
    """
    tokens = np.asarray(tokens)
    mask = np.asarray(mask, dtype=bool)
    prev = np.concatenate([[False], mask[:-1]])
    span_start = mask & ~prev  # first token of each noise span
    num_spans = int(span_start.sum())
    if num_spans > len(sentinel_ids):
        raise ValueError(f"{num_spans} noise spans but only {len(sentinel_ids)} sentinels")
    span_number = np.cumsum(span_start) - 1  # noise span of each token (valid where mask)
    sentinels = np.asarray(sentinel_ids)[:max(num_spans, 1)]

    # Input: non-noise tokens, and the span's sentinel where each noise span starts.
    keep_in_input = ~mask | span_start
    inputs = np.where(span_start, sentinels[np.maximum(span_number, 0)], tokens)[keep_in_input]
    # Target: each span's sentinel, then its tokens.
    target_len = int(mask.sum()) + num_spans
    targets = np.empty(target_len, dtype=np.int64)
    noise_positions = np.flatnonzero(mask)
    # A token's place in the target: its rank among noise tokens plus one slot per sentinel so far.
    slot = np.arange(len(noise_positions)) + span_number[noise_positions] + 1
    targets[slot] = tokens[noise_positions]
    sentinel_slot = slot[span_start[noise_positions]] - 1
    targets[sentinel_slot] = sentinels[:num_spans]
    eos = np.array([eos_id], dtype=np.int64)
    inputs = np.concatenate([inputs.astype(np.int64), eos])
    targets = np.concatenate([targets, eos])
    if input_length is not None and len(inputs) > input_length:
        raise ValueError(f"corrupted input has {len(inputs)} tokens, more than {input_length}")
    return inputs, targets


def uncorrupt(inputs: np.ndarray, targets: np.ndarray, sentinel_ids: np.ndarray,
              eos_id: int) -> np.ndarray:
    """The raw tokens back from (input, target): the inverse of `corrupt`, used by tests and by
    anyone who wants to look at what a sample was made from."""
    # Raw tokens may contain EOS themselves (document boundaries): only the last one terminates.
    inputs, targets = np.asarray(inputs).tolist(), np.asarray(targets).tolist()
    if not inputs or inputs[-1] != eos_id or not targets or targets[-1] != eos_id:
        raise ValueError("input and target must both end with EOS (pass them without padding)")
    sentinel_set = {int(s) for s in sentinel_ids}
    spans = {}
    current = None
    for t in targets[:-1]:
        if t in sentinel_set:
            current = t
            spans[current] = []
        elif current is not None:
            spans[current].append(t)
    out = []
    for t in inputs[:-1]:
        out.extend(spans.get(t, []) if t in sentinel_set else [t])
    return np.asarray(out, dtype=np.int64)
