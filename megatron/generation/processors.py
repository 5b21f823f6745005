"""Logits processors: each `(sequences, scores) -> scores`, as transformers' (5.x,
generation/logits_process.py) with the same name and arithmetic, so that a search applying
them in transformers' order gives its ids.

`sequences` [rows, length] holds each row's ids so far, the decoder start included (as
transformers counts it); `scores` [rows, vocab] are float32 logits (greedy search, sampling) or
log-probabilities (beam search). A removed token gets -inf. `DecodingSettings.processors`
(settings.py) builds the list a search applies with `apply`.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch


class LogitsProcessor(Protocol):
    def __call__(self, sequences: torch.Tensor, scores: torch.Tensor) -> torch.Tensor: ...


def apply(processors: Sequence[LogitsProcessor], sequences: torch.Tensor,
          scores: torch.Tensor) -> torch.Tensor:
    """`scores` through each processor in turn."""
    for processor in processors:
        scores = processor(sequences, scores)
    return scores


class NoRepeatNGram:
    """transformers' NoRepeatNGramLogitsProcessor: -inf for each token that would repeat an
    n-gram of the row."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __call__(self, sequences: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        n, length = self.n, sequences.shape[1]
        if n <= 0 or length < n:
            return scores
        prefix = sequences[:, length + 1 - n:]
        windows = sequences.unfold(1, n, 1)  # [rows, windows, n]
        matches = (windows[..., :-1] == prefix[:, None, :]).all(dim=-1)
        vocab = scores.shape[-1]
        # a window that does not match bans the extra column `vocab`, cut off below
        banned = scores.new_zeros((scores.shape[0], vocab + 1), dtype=torch.bool)
        banned.scatter_(1, torch.where(matches, windows[..., -1].clamp(max=vocab), vocab), True)
        return scores.masked_fill(banned[:, :vocab], -float("inf"))


class ForcedEOS:
    """transformers' ForcedEOSTokenLogitsProcessor: at the last position of `max_length` (the
    decoder start included), only EOS (score 0, every other token -inf)."""

    def __init__(self, max_length: int, eos_id: int) -> None:
        self.max_length, self.eos_id = max_length, eos_id

    def __call__(self, sequences: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if sequences.shape[1] != self.max_length - 1:
            return scores
        forced = torch.full_like(scores, -float("inf"))
        forced[:, self.eos_id] = 0
        return forced


class Temperature:
    """transformers' TemperatureLogitsWarper: the scores divided by the temperature."""

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature

    def __call__(self, sequences: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return scores / self.temperature


class TopK:
    """transformers' TopKLogitsWarper: -inf below the k-th best score (ties kept)."""

    def __init__(self, top_k: int) -> None:
        self.top_k = top_k

    def __call__(self, sequences: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        k = min(self.top_k, scores.shape[-1])
        kth = torch.topk(scores, k)[0][..., -1, None]
        return scores.masked_fill(scores < kth, -float("inf"))


class TopP:
    """transformers' TopPLogitsWarper: keep the best tokens whose probabilities reach `top_p`
    (at least the best one)."""

    def __init__(self, top_p: float) -> None:
        self.top_p = top_p

    def __call__(self, sequences: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        sorted_scores, order = torch.sort(scores, descending=False)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - self.top_p)
        remove[..., -1:] = False
        return scores.masked_fill(remove.scatter(1, order, remove), -float("inf"))
