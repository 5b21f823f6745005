"""UL2's mixture of denoisers (Tay et al. 2022) as `--t5-objective ul2`, with the t5 library's
masking semantics (t5/data/preprocessors.py, read there; numpy here).

Each sample draws one denoiser, with probability proportional to its weight, from a generator
seeded by (seed, sample index) only, so a sample is the same in any layout, after a restart and
with any number of loader workers:

- R and X (kind, mean span, corruption rate): `random_spans_noise_mask` (round(L x rate) noise
  tokens in round(noise / mean span) spans of a uniformly random segmentation, starting with
  non-noise), noise spans to unique sentinels in the input, the kept spans to sentinels in the
  target (`noise_span_to_unique_sentinel` / `nonnoise_span_to_unique_sentinel`): what
  megatron/data/datasets/span_corruption.py does for T5. R is the regular setting, X the extreme one
  (long spans or a high rate).
- S: prefix LM (`random_prefix_noise_mask` with `drop_nonnoise_tokens` / `drop_noise_tokens`):
  the encoder reads a prefix, the decoder predicts the rest, no sentinel. `s_prefix` "t5" (the
  default, the t5 library's): the prefix length is uniform over [1, L - 1]. "density": uniform
  over [max(1, round((1 - 2 r)(L - 1))), L - 1] with the S denoiser's rate r, so that the
  target is r of the window on average (the reading of Megatron-LM PR #268 and of the UL2
  paper's "S (r = 0.25)"); see docs/ul2.md.
- Mode tokens: `[NLU]` for R, `[NLG]` for X, `[S2S]` for S (the paper's; a piece of the
  vocabulary is its one id, as `train_tokenizer.py --ul2-mode-tokens` makes them, other strings
  are tokenized by the run's tokenizer, or given as ids), prepended to the encoder input; off
  with a flag. The run warns once at start when one is several pieces (`describe_start`).

Every sample packs the same number of raw tokens (one packed stream, as T5's span corruption):
the largest window whose input fits the encoder under every denoiser (S, whose prefix may be the
whole window but one token, decides it: encoder length - 1 - the mode token's length + 1). The
decoder length is the longest target any denoiser can make (S again: the window); a shorter
`--decoder-seq-length` is refused naming the denoiser. `UL2Config.budget` computes both; the
run prints them at start and in --dry-run. One rule for every mean span (`problems`): an R or X
denoiser's noise in that window, round(window x rate), must hold one span of its mean length;
then its spans average 0.75 to 1.5 times the setting.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import numpy as np

from megatron.data.datasets.span_corruption import corrupt, random_spans_noise_mask

KINDS = ("R", "S", "X")
DEFAULT_MODE_TOKENS = {"R": "[NLU]", "S": "[S2S]", "X": "[NLG]"}
S_PREFIX = ("t5", "density")


@dataclass(frozen=True)
class Denoiser:
    """One denoiser: kind 'R', 'S' or 'X'; mean span and rate of R and X (S's rate is read only
    with s_prefix 'density'); its weight in the mixture."""

    kind: str
    mean_span: Optional[float] = None
    rate: Optional[float] = None
    weight: float = 1.0

    def describe(self) -> str:
        if self.kind == "S":
            return "S (prefix LM)" + (f" rate {self.rate:g}" if self.rate is not None else "")
        return f"{self.kind} (span {self.mean_span:g}, rate {self.rate:g})"


def _r(span, rate, weight=1.0):
    return Denoiser("R", float(span), float(rate), weight)


def _x(span, rate, weight=1.0):
    return Denoiser("X", float(span), float(rate), weight)


PRESETS: Dict[str, Tuple[Denoiser, ...]] = {
    # the UL2 paper's seven, drawn with equal probability
    "ul2": (_r(3, 0.15), _r(8, 0.15), Denoiser("S", None, 0.25), _x(3, 0.5), _x(8, 0.5),
            _x(64, 0.15), _x(64, 0.5)),
    # U-PaLM's UL2R mixture: 50% S, 25% R (span 3, 15%), 25% X (span 32, 50%)
    "upalm": (Denoiser("S", None, 0.25, 0.5), _r(3, 0.15, 0.25), _x(32, 0.5, 0.25)),
}


def parse_denoisers(spec: str) -> Tuple[Denoiser, ...]:
    """`--ul2-denoisers`: a preset name (PRESETS), a JSON file, or inline JSON: a list of
    {"kind": "R"|"S"|"X", "mean_span": m, "rate": r, "weight": w}.

    Raises:
        ValueError: naming the flag and the bad entry."""
    if spec in PRESETS:
        return PRESETS[spec]
    flag = f"--ul2-denoisers {spec}"
    try:
        text = open(spec, encoding="utf-8").read() if os.path.isfile(spec) else spec
        entries = json.loads(text)
    except (OSError, ValueError) as e:
        raise ValueError(f"{flag}: not a preset ({', '.join(PRESETS)}) nor readable JSON ({e})") \
            from None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{flag}: a JSON list of denoisers is needed")
    out = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or entry.get("kind") not in KINDS or \
                set(entry) - {"kind", "mean_span", "rate", "weight"}:
            raise ValueError(f"{flag}: entry {i} must be {{\"kind\": R|S|X, \"mean_span\", "
                             f"\"rate\", \"weight\"}}, not {entry!r}")
        try:
            out.append(Denoiser(entry["kind"],
                                None if entry.get("mean_span") is None
                                else float(entry["mean_span"]),
                                None if entry.get("rate") is None else float(entry["rate"]),
                                float(entry.get("weight", 1.0))))
        except (TypeError, ValueError):
            raise ValueError(f"{flag}: entry {i} has a non-numeric field: {entry!r}") from None
    return tuple(out)


@dataclass(frozen=True)
class UL2Config:
    """The mixture, the mode tokens (kind -> ids; None: none) and the S prefix rule;
    `mode_pieces` (kind, text, pieces) of each mode token, read only by the start warning."""

    denoisers: Tuple[Denoiser, ...] = PRESETS["ul2"]
    mode_tokens: Optional[Tuple[Tuple[str, Tuple[int, ...]], ...]] = None
    s_prefix: str = "t5"
    mode_pieces: Optional[Tuple[Tuple[str, str, Tuple[str, ...]], ...]] = \
        field(default=None, compare=False)

    @property
    def weights(self) -> np.ndarray:
        w = np.asarray([d.weight for d in self.denoisers], dtype=np.float64)
        return w / w.sum()

    @functools.cached_property
    def _cumulative(self) -> np.ndarray:
        return np.cumsum(self.weights)

    @functools.cached_property
    def _modes(self) -> Dict[str, np.ndarray]:
        return {kind: np.asarray(ids, dtype=np.int64) for kind, ids in (self.mode_tokens or ())}

    def draw(self, rng: np.random.Generator) -> int:
        """The index of a denoiser drawn with probability proportional to its weight."""
        which = int(np.searchsorted(self._cumulative, rng.random(), side="right"))
        return min(which, len(self.denoisers) - 1)

    def mode(self, kind: str) -> Tuple[int, ...]:
        return dict(self.mode_tokens or ()).get(kind, ())

    def problems(self, encoder_length: int, num_sentinels: int) -> list:
        """Why the mixture cannot make samples (the flag named)."""
        out = []
        weights = [d.weight for d in self.denoisers]
        if any(not np.isfinite(w) or w < 0 for w in weights) or not sum(weights) > 0:
            out.append(f"--ul2-denoisers: weights {weights} must be >= 0 with a positive sum")
        if self.s_prefix not in S_PREFIX:
            out.append(f"--ul2-s-prefix {self.s_prefix}: choose one of {', '.join(S_PREFIX)}")
        for d in self.denoisers:
            if d.kind == "S":
                rate = d.rate if self.s_prefix == "density" else None
                if rate is not None and not 0 < rate <= 0.5:
                    out.append(f"--ul2-denoisers: {d.describe()}: an S rate must be in (0, 0.5]")
                continue
            if d.rate is None or not 0 < d.rate < 1:
                out.append(f"--ul2-denoisers: {d.kind} rate {d.rate} must be in (0, 1)")
            if d.mean_span is None or d.mean_span < 1:
                out.append(f"--ul2-denoisers: {d.kind} mean span {d.mean_span} must be >= 1")
        if out:
            return out
        raw = self._raw_length(encoder_length)
        if raw < 2:
            return [f"--encoder-seq-length {encoder_length} is too short for UL2 with these "
                    f"mode tokens"]
        for d in self._drawn:
            # The one rule for every mean span (docs/ul2.md): the window's noise holds one span
            # of it, else t5's one span of all the noise would silently be far shorter.
            if d.kind != "S" and not self._holds_a_span(encoder_length, d):
                out.append(f"--ul2-denoisers: {d.describe()}: a {raw}-token window "
                           f"(--encoder-seq-length {encoder_length}) has "
                           f"{_spans(raw, d)[0]} noise tokens, fewer than one span of "
                           f"{d.mean_span:g}; it needs round(window x rate) >= mean span: "
                           f"--encoder-seq-length {self._shortest_encoder(d, encoder_length)} "
                           f"or more, or a shorter mean span")
        if out:
            return out
        for d in self.denoisers:
            if d.kind != "S" and _spans(raw, d)[1] > num_sentinels:
                out.append(f"--ul2-denoisers: {d.describe()} makes {_spans(raw, d)[1]} noise "
                           f"spans of {raw} tokens but the tokenizer has {num_sentinels} "
                           f"sentinels (--vocab-extra-ids)")
        return out

    def _holds_a_span(self, encoder_length: int, d: Denoiser) -> bool:
        """Whether `d`'s noise in the window of `encoder_length` holds one mean span."""
        return _spans(self._raw_length(encoder_length), d)[0] >= d.mean_span

    def _shortest_encoder(self, d: Denoiser, encoder_length: int) -> int:
        """The shortest encoder length whose window holds one span of `d` (doubling, then
        bisection: the window grows with the encoder)."""
        low, high = encoder_length, 2 * encoder_length
        while not self._holds_a_span(high, d):
            low, high = high, 2 * high
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (low, middle) if self._holds_a_span(middle, d) else (middle, high)
        return high

    def mode_token_warning(self) -> Optional[str]:
        """The start's warning line when a mode token is more than one piece, else None."""
        long = [(kind, text, pieces) for kind, text, pieces in (self.mode_pieces or ())
                if len(pieces) > 1]
        if not long:
            return None
        named = "; ".join(f"{text} ({kind}) is {len(pieces)} pieces: {' '.join(pieces)}"
                          for kind, text, pieces in long)
        shared = os.path.commonprefix([list(pieces) for _, _, pieces in self.mode_pieces])
        if len(self.mode_pieces) > 1 and shared:  # the model tells the modes apart later
            named += f" (all start with {' '.join(shared)})"
        return (f"warning: UL2 mode tokens of more than one piece in this tokenizer: {named}. "
                f"Train the tokenizer with data_tools/train_tokenizer.py --ul2-mode-tokens to "
                f"make each one id")

    def describe_start(self, encoder_length: int, decoder_length: Optional[int] = None) -> str:
        """The run's UL2 lines at start: `describe_budget`, then `mode_token_warning` if any."""
        warning = self.mode_token_warning()
        budget = self.describe_budget(encoder_length, decoder_length)
        return budget if warning is None else f"{budget}\n{warning}"

    # Lengths (module docstring) -------------------------------------------------------------
    def _lengths(self, raw: int, d: Denoiser) -> Tuple[int, int]:
        """(longest input, longest target) of `raw` tokens under `d`, EOS and mode included."""
        mode = len(self.mode(d.kind))
        if d.kind == "S":
            return raw + mode, raw - self.min_prefix(raw, d) + 1
        noise, spans = _spans(raw, d)
        return raw - noise + spans + 1 + mode, noise + spans + 1

    @property
    def _drawn(self) -> Tuple[Denoiser, ...]:
        """The denoisers that can be drawn (a weight of 0 sets no length)."""
        return tuple(d for d in self.denoisers if d.weight > 0)

    def _raw_length(self, encoder_length: int) -> int:
        """The largest window whose input fits the encoder under every denoiser (R and X
        alone fit more raw tokens than the encoder holds, as T5's span corruption does)."""
        def fits(raw: int) -> bool:
            return all(self._lengths(raw, d)[0] <= encoder_length for d in self._drawn)
        raw = encoder_length
        while raw > 1 and not fits(raw):
            raw -= 1
        while fits(raw + 1) and raw < 4 * encoder_length:
            raw += 1
        return raw

    def budget(self, encoder_length: int, decoder_length: Optional[int] = None
               ) -> Tuple[int, int, int]:
        """(raw tokens per sample, encoder length, decoder length).

        Raises:
            ValueError: --decoder-seq-length too short for a denoiser (named)."""
        raw = self._raw_length(encoder_length)
        need = {d: self._lengths(raw, d)[1] for d in self._drawn}
        longest = max(need.values())
        if decoder_length is not None:
            short = [d for d, n in need.items() if n > decoder_length]
            if short:
                d = max(short, key=need.get)
                raise ValueError(f"--decoder-seq-length {decoder_length} is too short for the "
                                 f"UL2 denoiser {d.describe()}: its targets reach {need[d]} "
                                 f"tokens of a {raw}-token window (omit the flag to take "
                                 f"{longest})")
            return raw, encoder_length, decoder_length
        return raw, encoder_length, longest

    def describe_budget(self, encoder_length: int, decoder_length: Optional[int] = None) -> str:
        raw, enc, dec = self.budget(encoder_length, decoder_length)
        parts = [f"{self.describe_denoiser(d)} weight {w:.3f}: input <= "
                 f"{self._lengths(raw, d)[0]}, "
                 f"target <= {self._lengths(raw, d)[1]}"
                 for d, w in zip(self.denoisers, self.weights)]
        return (f"UL2: {raw} raw tokens per sample, encoder {enc}, decoder {dec}; "
                + "; ".join(parts))

    def describe_denoiser(self, d: Denoiser) -> str:
        if d.kind == "S" and self.s_prefix == "t5":
            return "S (prefix LM, prefix uniform over [1, L - 1])"
        return d.describe()

    def min_prefix(self, raw: int, d: Denoiser) -> int:
        if self.s_prefix == "density" and d.rate is not None:
            return min(raw - 1, max(1, int(round((1 - 2 * d.rate) * (raw - 1)))))
        return 1


def _spans(raw: int, d: Denoiser) -> Tuple[int, int]:
    """(noise tokens, noise spans) of random_spans_noise_mask on `raw` tokens."""
    noise = min(max(int(round(raw * d.rate)), 1), raw - 1)
    spans = max(int(round(noise / d.mean_span)), 1)
    return noise, min(spans, noise, raw - noise)


def denoise(raw: np.ndarray, config: UL2Config, sentinels: np.ndarray, eos_id: int,
            rng: np.random.Generator) -> Tuple[int, np.ndarray, np.ndarray]:
    """(index of the denoiser drawn, encoder input, target) of raw tokens, both ending in EOS."""
    which = config.draw(rng)
    d = config.denoisers[which]
    eos = np.array([eos_id], dtype=np.int64)
    if d.kind == "S":  # random_prefix_noise_mask: the prefix is the input, the rest the target
        low = config.min_prefix(len(raw), d)  # a row of Megatron's layout may be 1 token long
        prefix = int(rng.integers(low, len(raw))) if len(raw) > low else len(raw)
        inputs = np.concatenate([raw[:prefix], eos])
        targets = np.concatenate([raw[prefix:], eos])
    else:
        mask = random_spans_noise_mask(len(raw), d.rate, d.mean_span, rng)
        inputs, targets = corrupt(raw, mask, sentinels, eos_id)
    mode = config._modes.get(d.kind)
    if mode is not None:
        inputs = np.concatenate([mode, inputs])
    return which, inputs, targets


def mode_token_ids(tokenizer, values: Dict[str, str]) -> Tuple[Tuple[str, Tuple[int, ...]], ...]:
    """Each kind's mode token: "12,13" (ids) as given; a piece of the vocabulary (a user-defined
    symbol of `train_tokenizer.py --ul2-mode-tokens`) its one id; else the text tokenized (no
    EOS).

    Raises:
        ValueError: an empty token."""
    out = []
    for kind in KINDS:
        text = values[kind]
        if text.replace(",", "").strip().isdigit():
            ids = tuple(int(t) for t in text.split(",") if t.strip())
        elif _piece_id(tokenizer, text) is not None:
            # not encode(): SentencePiece would put its dummy-prefix piece "▁" in front
            ids = (_piece_id(tokenizer, text),)
        else:
            ids = tuple(int(i) for i in tokenizer.encode(text))
        if not ids:
            raise ValueError(f"--ul2-{kind.lower()}-denoiser-token {text!r} gives no token")
        out.append((kind, ids))
    return tuple(out)


def _piece_id(tokenizer, text: str) -> Optional[int]:
    """The id of `text` when it is one piece of the vocabulary, else None."""
    tid = int(tokenizer.piece_to_id(text))
    if tid == tokenizer.unk_id and text != tokenizer.id_to_piece(tokenizer.unk_id):
        return None
    return tid


def mode_token_pieces(tokenizer, values: Dict[str, str],
                      modes: Tuple[Tuple[str, Tuple[int, ...]], ...]
                      ) -> Tuple[Tuple[str, str, Tuple[str, ...]], ...]:
    """(kind, text, pieces) of each mode token of `mode_token_ids`, for the start warning."""
    return tuple((kind, values[kind], tuple(tokenizer.id_to_piece(i) for i in ids))
                 for kind, ids in modes)


def describe_sample(config: UL2Config, which: int) -> Dict[str, object]:
    """inspect_dataset's fields of a denoiser."""
    d = config.denoisers[which]
    return {"denoiser_kind": d.kind,
            "mean_span": None if d.kind == "S" else d.mean_span,
            "corruption_rate": d.rate if d.kind != "S" or config.s_prefix == "density" else None}

