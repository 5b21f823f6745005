"""Sentence splitting for `--split-sentences`, offline and in one pass.

English (and other space-separated text) goes through nltk's Punkt algorithm with parameters that
are either shipped with the package (`assets/punkt_english.json`, made by
`data_tools/train_punkt.py`) or trained on the input itself by `train_punkt_parameters`; nothing is
ever downloaded (nltk's downloader is never called). Chinese and Japanese text is cut after
sentence-final punctuation (。！？；… and their closing quotes/brackets), then each piece still goes
through Punkt so that mixed text works.

Parameters are stored as JSON, not pickles, so loading them executes nothing.
"""

from __future__ import annotations

import json
import os
import re
from typing import Iterable, List, Optional, Tuple

DEFAULT_PUNKT_PARAMS = os.path.join(os.path.dirname(__file__), "assets", "punkt_english.json")

# A run of CJK sentence-final marks, then any closing quotes or brackets that belong to the sentence.
_CJK_SENTENCE_END = re.compile(r"[。！？；…]+[”’」』）》〉】\"')]*")
_PUNKT_CANDIDATE = re.compile(r"[.?!]")


def _punkt_module():
    # Imported lazily: nltk is slow to import and only --split-sentences needs it.
    from nltk.tokenize import punkt

    return punkt


def save_punkt_parameters(params, path: str) -> None:
    """Write Punkt parameters as JSON (atomically)."""
    data = {
        "abbrev_types": sorted(params.abbrev_types),
        "collocations": sorted([list(pair) for pair in params.collocations]),
        "sent_starters": sorted(params.sent_starters),
        "ortho_context": dict(sorted(params.ortho_context.items())),
    }
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False, indent=0)
    os.replace(tmp, path)


def load_punkt_parameters(path: str):
    """Read Punkt parameters written by `save_punkt_parameters`.

    Raises:
        ValueError: the file is not a Punkt parameter file; the message names it.
    """
    punkt = _punkt_module()
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        params = punkt.PunktParameters()
        params.abbrev_types = set(data["abbrev_types"])
        params.collocations = {tuple(pair) for pair in data["collocations"]}
        params.sent_starters = set(data["sent_starters"])
        for word, flags in data["ortho_context"].items():
            params.ortho_context[word] = int(flags)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a Punkt parameter file ({e})") from e
    return params


def train_punkt_parameters(texts: Iterable[str]):
    """Train Punkt parameters on `texts` (unsupervised, as nltk's PunktTrainer does)."""
    punkt = _punkt_module()
    trainer = punkt.PunktTrainer()
    trainer.INCLUDE_ALL_COLLOCS = True
    for text in texts:
        trainer.train(text, finalize=False)
    trainer.finalize_training()
    return trainer.get_params()


class SentenceSplitter:
    """Splits a document into sentences.

    Args:
        punkt_params: Punkt parameters (see `load_punkt_parameters`); None loads the shipped ones.
        keep_newlines: keep the whitespace (newlines included) that follows each sentence inside it,
            so that joining the sentences gives back the document; otherwise sentences are stripped.
    """

    def __init__(self, punkt_params=None, keep_newlines: bool = False) -> None:
        punkt = _punkt_module()
        if punkt_params is None:
            punkt_params = load_punkt_parameters(DEFAULT_PUNKT_PARAMS)
        self._punkt = punkt.PunktSentenceTokenizer(punkt_params)
        self.keep_newlines = keep_newlines

    def spans(self, text: str) -> List[Tuple[int, int]]:
        """Character spans of the sentences of `text`, without surrounding whitespace."""
        out: List[Tuple[int, int]] = []
        start = 0
        for match in _CJK_SENTENCE_END.finditer(text):
            self._add_piece(text, start, match.end(), out)
            start = match.end()
        self._add_piece(text, start, len(text), out)
        return out

    def _add_piece(self, text: str, start: int, end: int, out: List[Tuple[int, int]]) -> None:
        piece = text[start:end]
        if not piece.strip():
            return
        if _PUNKT_CANDIDATE.search(piece) is None:
            lead = len(piece) - len(piece.lstrip())
            out.append((start + lead, start + len(piece.rstrip())))
            return
        for s, e in self._punkt.span_tokenize(piece):
            out.append((start + s, start + e))

    def split(self, text: str) -> List[str]:
        """The sentences of `text` (see `keep_newlines`)."""
        spans = self.spans(text)
        if not self.keep_newlines:
            return [text[s:e] for s, e in spans]
        # Each sentence runs up to where the next begins: nothing of the text is lost.
        out = []
        for k, (s, _) in enumerate(spans):
            end = spans[k + 1][0] if k + 1 < len(spans) else len(text)
            out.append(text[(0 if k == 0 else s):end])
        return out


def make_splitter(
    punkt_params_path: Optional[str] = None, keep_newlines: bool = False
) -> SentenceSplitter:
    params = load_punkt_parameters(punkt_params_path) if punkt_params_path else None
    return SentenceSplitter(params, keep_newlines=keep_newlines)
