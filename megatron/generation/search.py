"""Greedy search, sampling and beam search over a decoder's `step(ids) -> logits`, as
`DecodingSettings` (settings.py) says.

The semantics are transformers' `generate` (5.x, generation/utils.py): the settings' logits
processors (processors.py) in transformers' order, applied by every search; finished rows
continued with the pad id; beam search's top-2K candidates, length penalty, early stopping
(True, False or "never") and its stopping heuristic, step for step, so that the ids are equal
on the same weights.

`decoder` is any object with `step(ids [rows]) -> logits [rows, vocab] (float32)` and, for
beam search, `reorder(rows)` (megatron/generation/cache.py's Decoder). Each function returns
one `Hypothesis` per input: the generated ids (without the decoder start, up to and including
the first EOS) and, for beam search, the beam's score (summed log-probabilities divided by
length ** length_penalty). Greedy search and sampling also take `stop(rows, ids) -> bool
[len(rows)]`: each step, called with the still unfinished rows and their generated ids (start
left out), it ends those rows it marks as EOS ends them (continued with the pad id), as
transformers' stopping criteria do (lm-evaluation-harness's stop strings,
megatron/evaluation/harness_lm.py).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, List, NamedTuple, Optional, Union

import torch

from megatron.generation.processors import apply
from megatron.generation.settings import DecodingSettings, SpecialTokens

NEG = -1.0e9  # transformers' "impossible" score in beam search

Device = Union[str, torch.device]

Stop = Callable[[List[int], List[List[int]]], List[bool]]


class Hypothesis(NamedTuple):
    ids: List[int]
    score: Optional[float] = None


def search(decoder, batch: int, tokens: SpecialTokens, settings: DecodingSettings,
           device: Device = "cpu", stop: Optional[Stop] = None) -> List[Hypothesis]:
    """The search `settings` asks for: beam search with num_beams > 1 (`decoder` then runs
    batch x num_beams rows), else sampling with do_sample, else greedy search. `stop`
    (module doc) is not applied by beam search."""
    if settings.num_beams > 1:
        return beam_search(decoder, batch, tokens, settings, device)
    if settings.do_sample:
        return sample(decoder, batch, tokens, settings, device, stop)
    return greedy(decoder, batch, tokens, settings, device, stop)


def greedy(decoder, batch: int, tokens: SpecialTokens, settings: DecodingSettings,
           device: Device = "cpu", stop: Optional[Stop] = None) -> List[Hypothesis]:
    """Greedy search: each step the best token of the processed scores."""
    return _token_by_token(decoder, batch, tokens, settings, device,
                           lambda scores: scores.argmax(dim=-1), stop)


def sample(decoder, batch: int, tokens: SpecialTokens, settings: DecodingSettings,
           device: Device = "cpu", stop: Optional[Stop] = None) -> List[Hypothesis]:
    """Ancestral sampling from the processed distribution (torch.multinomial on a generator
    seeded with settings.seed: the same ids for the same seed, on every tensor-parallel
    rank)."""
    generator = torch.Generator(device=device).manual_seed(settings.seed)

    def pick(scores: torch.Tensor) -> torch.Tensor:
        return torch.multinomial(scores.softmax(dim=-1), 1, generator=generator)[:, 0]

    return _token_by_token(decoder, batch, tokens, settings, device, pick, stop)


def _token_by_token(decoder, batch: int, tokens: SpecialTokens, settings: DecodingSettings,
                    device: Device, pick: Callable[[torch.Tensor], torch.Tensor],
                    stop: Optional[Stop] = None) -> List[Hypothesis]:
    """One row per input, extended by `pick(processed scores)` until every row ended (EOS,
    or `stop`)."""
    processors = settings.processors(tokens.eos)
    sequences = torch.full((batch, 1), tokens.start, dtype=torch.long, device=device)
    unfinished = torch.ones(batch, dtype=torch.bool, device=device)
    for _ in range(settings.max_new_tokens):
        scores = apply(processors, sequences, decoder.step(sequences[:, -1]))
        token = torch.where(unfinished, pick(scores), tokens.pad)
        sequences = torch.cat([sequences, token[:, None]], dim=1)
        unfinished &= token != tokens.eos
        if stop is not None and unfinished.any():
            _apply_stop(stop, sequences, unfinished)
        if not unfinished.any():
            break
    return [Hypothesis(_cut(row[1:], tokens.eos)) for row in sequences.tolist()]


def _apply_stop(stop: Stop, sequences: torch.Tensor, unfinished: torch.Tensor) -> None:
    """End (in `unfinished`, in place) the unfinished rows `stop` marks."""
    rows = unfinished.nonzero()[:, 0].tolist()
    ids = sequences[rows, 1:].tolist()
    ended = [row for row, end in zip(rows, stop(rows, ids)) if end]
    if ended:
        unfinished[ended] = False


def _cut(row: List[int], eos_id: int) -> List[int]:
    return row[:row.index(eos_id) + 1] if eos_id in row else row


# Beam search ------------------------------------------------------------------------------------
def _gather(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """tensor [batch, beams, ...] at beams `index` [batch, k]."""
    while index.dim() < tensor.dim():
        index = index.unsqueeze(-1)
    return torch.take_along_dim(tensor, index, dim=1)


@dataclasses.dataclass
class _Beams:
    """Beam search's state, batch B x beams K: the open hypotheses (`running`, padded to
    max_length, with their summed log-probabilities) and the K best finished ones (`sequences`,
    their length-penalised `scores`, `lengths` in generated tokens, `finished`: a real one
    there); `improvable`: [B, 1] whether an open hypothesis could still beat the finished."""
    running: torch.Tensor
    running_scores: torch.Tensor
    sequences: torch.Tensor
    scores: torch.Tensor
    lengths: torch.Tensor
    finished: torch.Tensor
    improvable: torch.Tensor


class _Candidates(NamedTuple):
    """A step's top-2K candidates [B, 2K]: summed log-probabilities, the beam each extends,
    the token, the whole sequence, and whether it ends (EOS or max_length)."""
    log_probs: torch.Tensor
    beam: torch.Tensor
    token: torch.Tensor
    sequences: torch.Tensor
    hits: torch.Tensor


def _start_beams(B: int, K: int, max_length: int, tokens: SpecialTokens,
                 device: Device) -> _Beams:
    running = torch.full((B, K, max_length), tokens.pad, dtype=torch.long, device=device)
    running[:, :, 0] = tokens.start
    running_scores = torch.zeros(B, K, device=device)
    running_scores[:, 1:] = NEG  # the K beams start equal: only the first one counts
    return _Beams(running=running, running_scores=running_scores, sequences=running.clone(),
                  scores=torch.full((B, K), NEG, device=device),
                  lengths=torch.zeros(B, K, dtype=torch.long, device=device),
                  finished=torch.zeros(B, K, dtype=torch.bool, device=device),
                  improvable=torch.ones(B, 1, dtype=torch.bool, device=device))


def _candidates(beams: _Beams, logits: torch.Tensor, processors, cur_len: int, eos_id: int,
                max_length: int) -> _Candidates:
    """The top-2K extensions of the open hypotheses (enough that K stay open after any of
    them end), by summed processed log-probabilities."""
    B, K = beams.running_scores.shape
    log_probs = torch.log_softmax(logits, dim=-1)
    log_probs = apply(processors, beams.running[:, :, :cur_len].reshape(B * K, cur_len),
                      log_probs)
    vocab = log_probs.shape[-1]
    log_probs = (log_probs.view(B, K, vocab) + beams.running_scores[:, :, None]).view(B, K * vocab)
    top_log_probs, top_index = torch.topk(log_probs, 2 * K)
    beam, token = top_index // vocab, top_index % vocab
    top_sequences = _gather(beams.running, beam)
    top_sequences[:, :, cur_len] = token
    hits = (token == eos_id) | (cur_len + 1 >= max_length)
    return _Candidates(top_log_probs, beam, token, top_sequences, hits)


def _continue_open(beams: _Beams, found: _Candidates) -> torch.Tensor:
    """The K best candidates that did not end become the open hypotheses; returns the rows
    [B, K] (of the decoder's B x K) they extend, for the decoder's reorder."""
    K = beams.running_scores.shape[1]
    open_log_probs = found.log_probs + found.hits.to(torch.float32) * NEG
    chosen = torch.topk(open_log_probs, K)[1]
    beams.running = _gather(found.sequences, chosen)
    beams.running_scores = _gather(open_log_probs, chosen)
    offsets = torch.arange(chosen.shape[0], device=chosen.device)[:, None] * K
    return _gather(found.beam, chosen) + offsets


def _merge_finished(beams: _Beams, found: _Candidates, cur_len: int,
                    settings: DecodingSettings) -> None:
    """Candidates among the top K that ended join the finished ones if they are better (not
    once K ended with early_stopping True, nor where nothing could improve)."""
    K = beams.scores.shape[1]
    just_finished = found.hits & (torch.arange(2 * K, device=found.hits.device) < K)[None, :]
    ended = found.log_probs / ((cur_len + 1 - 1) ** settings.length_penalty)
    full = beams.finished.all(dim=-1, keepdim=True) & (settings.early_stopping is True)
    ended += full.to(torch.float32) * NEG
    ended += (~beams.improvable).to(torch.float32) * NEG
    ended += (~just_finished) * NEG
    merged = torch.topk(torch.cat([beams.scores, ended], dim=1), K)[1]
    beams.sequences = _gather(torch.cat([beams.sequences, found.sequences], dim=1), merged)
    beams.scores = _gather(torch.cat([beams.scores, ended], dim=1), merged)
    ended_lengths = torch.full_like(ended, cur_len, dtype=torch.long)
    beams.lengths = _gather(torch.cat([beams.lengths, ended_lengths], dim=1), merged)
    beams.finished = _gather(torch.cat([beams.finished, just_finished], dim=1), merged)


def _update_improvable(beams: _Beams, cur_len: int, max_length: int,
                       settings: DecodingSettings) -> None:
    """transformers' _check_early_stop_heuristic: whether the best open hypothesis could
    still beat the worst finished one (at cur_len, or with "never" at max_length)."""
    if settings.early_stopping == "never" and settings.length_penalty > 0.0:
        best_length = max_length - 1
    else:
        best_length = cur_len - 1
    best_possible = beams.running_scores[:, :1] / (best_length ** settings.length_penalty)
    worst = torch.where(beams.finished, torch.min(beams.scores, dim=1, keepdim=True)[0], NEG)
    beams.improvable = beams.improvable & (best_possible > worst).any(dim=-1, keepdim=True)


def _done(beams: _Beams, found: _Candidates, settings: DecodingSettings) -> bool:
    return not (beams.improvable.any()
                and not (beams.finished.all() and settings.early_stopping is True)
                and not found.hits.all())


def beam_search(decoder, batch: int, tokens: SpecialTokens, settings: DecodingSettings,
                device: Device = "cpu") -> List[Hypothesis]:
    """transformers' `_beam_search` (one EOS id, prompt = the decoder start): `decoder` runs
    batch x settings.num_beams rows, input-major."""
    max_length = 1 + settings.max_new_tokens
    processors = settings.processors(tokens.eos)
    beams = _start_beams(batch, settings.num_beams, max_length, tokens, device)
    cur_len = 1
    while True:
        logits = decoder.step(beams.running[:, :, cur_len - 1].reshape(-1))
        found = _candidates(beams, logits, processors, cur_len, tokens.eos, max_length)
        parents = _continue_open(beams, found)
        _merge_finished(beams, found, cur_len, settings)
        decoder.reorder(parents.reshape(-1))
        cur_len += 1
        _update_improvable(beams, cur_len, max_length, settings)
        if _done(beams, found, settings):
            break
    return [Hypothesis(beams.sequences[b, 0, 1:1 + int(beams.lengths[b, 0])].tolist(),
                       float(beams.scores[b, 0])) for b in range(batch)]
