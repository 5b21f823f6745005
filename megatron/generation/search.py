"""Greedy search, sampling and beam search over a decoder's `step(ids) -> logits`.

The semantics are transformers' `generate` (5.x, generation/utils.py and logits_process.py):
the same logits processors in the same order (no-repeat n-grams; then temperature, top-k,
top-p when sampling), finished rows continued with the pad id, and beam search's top-2K
candidates, length penalty, early stopping (True, False or "never") and its stopping heuristic,
step for step, so that the ids are equal on the same weights.

`decoder` is any object with `step(ids [rows]) -> logits [rows, vocab] (float32)` and, for
beam search, `reorder(rows)` (megatron/generation/cache.py's Decoder). Each function returns
one `Hypothesis` per input: the generated ids (without the decoder start, up to and including
the first EOS) and, for beam search, the beam's score (summed log-probabilities divided by
length ** length_penalty).
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Union

import torch

NEG = -1.0e9  # transformers' "impossible" score in beam search


class Hypothesis(NamedTuple):
    ids: List[int]
    score: Optional[float] = None


def ban_repeated_ngrams(sequences: torch.Tensor, scores: torch.Tensor, n: int) -> torch.Tensor:
    """`scores` [rows, vocab] with -inf for each token that would repeat an n-gram of
    `sequences` [rows, length] (the decoder start included, as transformers counts it)."""
    length = sequences.shape[1]
    if n <= 0 or length < n:
        return scores
    prefix = sequences[:, length + 1 - n:]
    windows = sequences.unfold(1, n, 1)  # [rows, windows, n]
    matches = (windows[..., :-1] == prefix[:, None, :]).all(dim=-1)
    vocab = scores.shape[-1]
    banned = scores.new_zeros((scores.shape[0], vocab + 1), dtype=torch.bool)
    banned.scatter_(1, torch.where(matches, windows[..., -1].clamp(max=vocab), vocab), True)
    return scores.masked_fill(banned[:, :vocab], -float("inf"))


def warp(scores: torch.Tensor, temperature: float = 1.0, top_k: int = 0,
         top_p: float = 1.0) -> torch.Tensor:
    """transformers' sampling warpers in their order: temperature, top-k, top-p (removed
    tokens get -inf; at least one token is kept)."""
    if temperature != 1.0:
        scores = scores / temperature
    if top_k > 0:
        k = min(top_k, scores.shape[-1])
        kth = torch.topk(scores, k)[0][..., -1, None]
        scores = scores.masked_fill(scores < kth, -float("inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - top_p)
        remove[..., -1:] = False
        scores = scores.masked_fill(remove.scatter(1, order, remove), -float("inf"))
    return scores


def _cut(row: List[int], eos_id: int) -> List[int]:
    return row[:row.index(eos_id) + 1] if eos_id in row else row


def greedy(decoder, batch: int, start_id: int, eos_id: int, pad_id: int, max_new_tokens: int,
           no_repeat_ngram_size: int = 0, sample: bool = False, temperature: float = 1.0,
           top_k: int = 0, top_p: float = 1.0, seed: int = 0,
           device: Union[str, torch.device] = "cpu") -> List[Hypothesis]:
    """Greedy search, or with `sample` ancestral sampling from the warped distribution
    (torch.multinomial on a generator seeded with `seed`: the same ids for the same seed, on
    every tensor-parallel rank)."""
    sequences = torch.full((batch, 1), start_id, dtype=torch.long, device=device)
    unfinished = torch.ones(batch, dtype=torch.bool, device=device)
    generator = torch.Generator(device=device).manual_seed(seed) if sample else None
    for _ in range(max_new_tokens):
        scores = ban_repeated_ngrams(sequences, decoder.step(sequences[:, -1]),
                                     no_repeat_ngram_size)
        if sample:
            probs = warp(scores, temperature, top_k, top_p).softmax(dim=-1)
            token = torch.multinomial(probs, 1, generator=generator)[:, 0]
        else:
            token = scores.argmax(dim=-1)
        token = torch.where(unfinished, token, pad_id)
        sequences = torch.cat([sequences, token[:, None]], dim=1)
        unfinished &= token != eos_id
        if not unfinished.any():
            break
    return [Hypothesis(_cut(row[1:], eos_id)) for row in sequences.tolist()]


def _gather(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """tensor [batch, beams, ...] at beams `index` [batch, k]."""
    while index.dim() < tensor.dim():
        index = index.unsqueeze(-1)
    return torch.take_along_dim(tensor, index, dim=1)


def beam_search(decoder, batch: int, num_beams: int, start_id: int, eos_id: int, pad_id: int,
                max_new_tokens: int, length_penalty: float = 1.0,
                early_stopping: Union[bool, str] = False, no_repeat_ngram_size: int = 0,
                device: Union[str, torch.device] = "cpu") -> List[Hypothesis]:
    """transformers' `_beam_search` (one EOS id, prompt = the decoder start): `decoder` runs
    batch x num_beams rows, input-major."""
    B, K = batch, num_beams
    keep = 2 * K  # candidates per step: enough that K stay open after any of them end
    max_length = 1 + max_new_tokens
    running = torch.full((B, K, max_length), pad_id, dtype=torch.long, device=device)
    running[:, :, 0] = start_id
    sequences = running.clone()
    running_scores = torch.zeros(B, K, device=device)
    running_scores[:, 1:] = NEG
    scores = torch.full((B, K), NEG, device=device)
    lengths = torch.zeros(B, K, dtype=torch.long, device=device)  # generated tokens
    finished = torch.zeros(B, K, dtype=torch.bool, device=device)
    improvable = torch.ones(B, 1, dtype=torch.bool, device=device)
    top_k_mask = torch.arange(keep, device=device) < K
    offsets = torch.arange(B, device=device)[:, None] * K
    cur_len = 1
    while True:
        logits = decoder.step(running[:, :, cur_len - 1].reshape(-1))
        log_probs = torch.log_softmax(logits, dim=-1)
        log_probs = ban_repeated_ngrams(running[:, :, :cur_len].reshape(B * K, cur_len),
                                        log_probs, no_repeat_ngram_size)
        vocab = log_probs.shape[-1]
        log_probs = (log_probs.view(B, K, vocab) + running_scores[:, :, None]).view(B, K * vocab)
        top_log_probs, top_index = torch.topk(log_probs, keep)
        beam, token = top_index // vocab, top_index % vocab
        top_sequences = _gather(running, beam)
        top_sequences[:, :, cur_len] = token
        hits = (token == eos_id) | (cur_len + 1 >= max_length)

        # the K best candidates that did not end continue
        open_log_probs = top_log_probs + hits.to(torch.float32) * NEG
        chosen = torch.topk(open_log_probs, K)[1]
        running = _gather(top_sequences, chosen)
        running_scores = _gather(open_log_probs, chosen)
        parents = _gather(beam, chosen) + offsets

        # candidates among the top K that ended join the finished ones if they are better
        just_finished = hits & top_k_mask[None, :]
        ended = top_log_probs / ((cur_len + 1 - 1) ** length_penalty)
        full = finished.all(dim=-1, keepdim=True) & (early_stopping is True)
        ended += full.to(torch.float32) * NEG
        ended += (~improvable).to(torch.float32) * NEG
        ended += (~just_finished) * NEG
        merged = torch.topk(torch.cat([scores, ended], dim=1), K)[1]
        sequences = _gather(torch.cat([sequences, top_sequences], dim=1), merged)
        scores = _gather(torch.cat([scores, ended], dim=1), merged)
        lengths = _gather(torch.cat([lengths, torch.full_like(ended, cur_len, dtype=torch.long)],
                                    dim=1), merged)
        finished = _gather(torch.cat([finished, just_finished], dim=1), merged)

        decoder.reorder(parents.reshape(-1))
        cur_len += 1
        # stopping heuristic (transformers' _check_early_stop_heuristic)
        if early_stopping == "never" and length_penalty > 0.0:
            best_length = max_length - 1
        else:
            best_length = cur_len - 1
        best_possible = running_scores[:, :1] / (best_length ** length_penalty)
        worst = torch.where(finished, torch.min(scores, dim=1, keepdim=True)[0], NEG)
        improvable = improvable & (best_possible > worst).any(dim=-1, keepdim=True)
        if not (improvable.any() and not (finished.all() and early_stopping is True)
                and not hits.all()):
            break
    out = []
    for b in range(B):
        n = int(lengths[b, 0])
        out.append(Hypothesis(sequences[b, 0, 1:1 + n].tolist(), float(scores[b, 0])))
    return out
