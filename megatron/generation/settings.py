"""How to decode, as one frozen value: `DecodingSettings`, and the token ids a search needs.

`python -m megatron.generate` builds it from its flags and lists its problems with every other
problem of the command line (`problems`, one line each naming the flag); fine-tuning's
validation builds a greedy one from --decoder-seq-length; the search functions
(megatron/generation/search.py) take it whole, and its `processors` are the logits processors
they all apply (megatron/generation/processors.py).
"""

from __future__ import annotations

import dataclasses
from typing import List, Mapping, NamedTuple, Union

from megatron.data.tokenizers.tokenizer_names import pad_id_of
from megatron.generation.processors import (ForcedEOS, LogitsProcessor, NoRepeatNGram,
                                            Temperature, TopK, TopP)

# each field's flag in `python -m megatron.generate` (the names of transformers' generate)
FLAGS = {f: "--" + f.replace("_", "-") for f in (
    "max_new_tokens", "num_beams", "length_penalty", "early_stopping", "no_repeat_ngram_size",
    "do_sample", "temperature", "top_k", "top_p", "seed")}

EARLY_STOPPING = {"true": True, "false": False, "never": "never"}


class SpecialTokens(NamedTuple):
    """The ids a search needs: the decoder start, EOS, and the pad id finished rows go on
    with."""
    start: int
    eos: int
    pad: int

    @classmethod
    def of(cls, tokenizer) -> "SpecialTokens":
        """A tokenizer's (the pad id by the one rule, tokenizer_names.pad_id_of)."""
        return cls(tokenizer.decoder_start_token_id, tokenizer.eos_id, pad_id_of(tokenizer))


@dataclasses.dataclass(frozen=True)
class DecodingSettings:
    """The settings of one decoding, as transformers' `generate` defines them.

    Build it, then check it once where the command line is checked (`problems`); the search
    functions trust it.
    """
    max_new_tokens: int = 64
    """New tokens at most (EOS included)."""
    num_beams: int = 1
    """1: greedy search or sampling; more: beam search."""
    length_penalty: float = 1.0
    """Beam search: a hypothesis scores its summed log-probabilities / length ** this."""
    early_stopping: Union[bool, str] = False
    """Beam search: stop when num_beams hypotheses ended (True), by transformers' heuristic
    (False) or never ("never")."""
    no_repeat_ngram_size: int = 0
    """Ban each token that would repeat an n-gram of this size (0: off)."""
    do_sample: bool = False
    """Sample from the processed distribution instead of taking the best token."""
    temperature: float = 1.0
    """Sampling: the logits divided by this."""
    top_k: int = 0
    """Sampling: keep the k best tokens (0: off)."""
    top_p: float = 1.0
    """Sampling: keep the smallest set of best tokens whose probability reaches this."""
    seed: int = 0
    """Sampling: the generator's seed (the same ids for the same seed, on every rank)."""
    forced_eos: bool = False
    """Force EOS as the last of max_new_tokens (transformers' forced_eos_token_id)."""

    @classmethod
    def from_flags(cls, values: Mapping[str, object]) -> "DecodingSettings":
        """From a command line's values (argparse's `vars(args)`): the fields present, with
        --early-stopping's words read as transformers' values."""
        kw = {f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values}
        if isinstance(kw.get("early_stopping"), str):
            kw["early_stopping"] = EARLY_STOPPING[kw["early_stopping"]]
        return cls(**kw)

    def problems(self) -> List[str]:
        """Every problem of these settings, one line each naming its flag (FLAGS)."""
        out = []
        for name in ("max_new_tokens", "num_beams"):
            if getattr(self, name) < 1:
                out.append(f"{FLAGS[name]} must be at least 1, not {getattr(self, name)}")
        if self.no_repeat_ngram_size < 0:
            out.append("--no-repeat-ngram-size must be 0 (off) or more")
        if self.do_sample and self.num_beams > 1:
            out.append("--do-sample with --num-beams > 1 (beam sampling) is not supported: "
                       "choose one")
        if self.temperature <= 0:
            out.append(f"--temperature must be positive, not {self.temperature}")
        if self.top_k < 0:
            out.append(f"--top-k must be 0 (off) or more, not {self.top_k}")
        if not 0 < self.top_p <= 1:
            out.append(f"--top-p must be in (0, 1], not {self.top_p}")
        if self.early_stopping not in (True, False, "never"):
            out.append(f"--early-stopping must be true, false or never, not "
                       f"{self.early_stopping!r}")
        return out

    def processors(self, eos_id: int) -> List[LogitsProcessor]:
        """The logits processors of these settings in transformers' order: the n-gram ban and
        the forced EOS, then, when sampling, temperature, top-k and top-p."""
        out: List[LogitsProcessor] = []
        if self.no_repeat_ngram_size > 0:
            out.append(NoRepeatNGram(self.no_repeat_ngram_size))
        if self.forced_eos:
            out.append(ForcedEOS(1 + self.max_new_tokens, eos_id))  # the start counts
        if self.do_sample:
            if self.temperature != 1.0:
                out.append(Temperature(self.temperature))
            if self.top_k > 0:
                out.append(TopK(self.top_k))
            if self.top_p < 1.0:
                out.append(TopP(self.top_p))
        return out

    def reseeded(self, offset: int) -> "DecodingSettings":
        """The same settings with the seed moved by `offset` (one micro-batch's)."""
        return dataclasses.replace(self, seed=self.seed + offset)
