"""T5's SentencePiece tokenizer: a SentencePiece model plus sentinel ids, laid out as T5 does.

The id layout is the one of Google's T5 checkpoints and of Hugging Face's ``T5Tokenizer``:

* ids ``0 .. sp_size - 1`` are the SentencePiece pieces (T5: ``<pad>`` = 0, ``</s>`` = 1,
  ``<unk>`` = 2, then ordinary pieces, then the 256 ``<0xNN>`` byte pieces if the model has byte
  fallback; bos is absent);
* ``extra_ids`` sentinels follow *in reverse*: ``<extra_id_0>`` has the highest id,
  ``id(<extra_id_i>) = sp_size + extra_ids - 1 - i``. (Megatron-LM's own SentencePiece wrapper
  appends them in increasing order instead; we follow T5/HF so that released checkpoints and their
  ``spiece.model`` work unchanged.)

Plain text is encoded by SentencePiece itself, so bulk encoding runs at its speed. Literal special
token strings in the text (``<extra_id_N>`` for N < extra_ids, and the model's ``<pad>``, ``</s>``,
``<unk>`` pieces) become their ids, as in HF: the text is cut at them, each remaining segment is
encoded on its own (so whitespace next to a special token disappears and the segment after it gets
SentencePiece's dummy-prefix ``▁``), and whitespace-only segments give no ids.

Known, deliberate differences from HF transformers 5.x (which re-implements the model with the
``tokenizers`` library instead of calling SentencePiece):

* HF builds the model with ``byte_fallback=False`` whatever the ``.model`` says, so a character
  outside the vocabulary becomes ``<unk>`` there; we keep SentencePiece's byte pieces (lossless,
  and what the model was trained for). Each run of byte pieces corresponds to one HF ``<unk>``.
* SentencePiece scores a whole text in one float32 lattice while HF scores each whitespace-separated
  word in float64; on long texts a near-tie between two segmentations (score difference ~1e-4) can
  occasionally be resolved differently. Both are valid segmentations of the same text.
* HF matches a literal ``<0xNN>`` in the text as a byte piece; SentencePiece (and we) do not.
* ``decode`` turns byte pieces back into text; HF prints them as ``<0xNN>``.

``build_tokenizer(resolve_tokenizer(...))`` is how the data tools and training make their
tokenizer from the flags: this one for a SentencePiece model, ``CPM2Tokenizer``
(``megatron/data/tokenizers/cpm2_tokenizer.py``) for a CPM-2 ``vocab.txt``; both have this interface.

This module needs only numpy and sentencepiece (no torch), so data tools can import it cheaply.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import sentencepiece as spm

from megatron.data.tokenizers.tokenizer_names import TokenizerNames

SENTINEL_FORMAT = "<extra_id_{}>"
_SPACE = "\u2581"  # SentencePiece's escaped whitespace "▁"


def available_cpus() -> int:
    # Respect CPU affinity (containers, taskset): hardware_concurrency, spm's default, does not.
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class T5Tokenizer(TokenizerNames):
    """SentencePiece model + ``extra_ids`` T5 sentinels (``<extra_id_0>`` has the highest id)."""

    def __init__(self, model_path: str, extra_ids: int = 100):
        """Load ``model_path`` (a SentencePiece ``.model``, e.g. T5's ``spiece.model``).

        Raises:
            ValueError: the file is missing or not a SentencePiece model, the model has no pad or
                no eos piece (T5 needs both), or it already has ``<extra_id_N>`` pieces.
        """
        model_path = os.fspath(model_path)
        if isinstance(extra_ids, bool) or not isinstance(extra_ids, (int, np.integer)) \
                or extra_ids < 0:
            raise ValueError(f"extra_ids must be a non-negative integer, not {extra_ids!r}")
        if not os.path.isfile(model_path):
            raise ValueError(f"{model_path}: no such SentencePiece model file")
        try:
            sp = spm.SentencePieceProcessor(model_file=model_path)
        except (OSError, RuntimeError) as e:
            raise ValueError(f"{model_path}: not a SentencePiece model ({e})") from None
        self.model_path = model_path
        self.extra_ids = int(extra_ids)
        self._sp = sp
        self.sp_vocab_size: int = sp.get_piece_size()
        self.vocab_size: int = self.sp_vocab_size + self.extra_ids
        self.pad_id: int = sp.pad_id()
        self.eos_id: int = sp.eos_id()
        self.unk_id: int = sp.unk_id()
        self.bos_id: int = sp.bos_id()  # -1 in the T5 layout
        if self.pad_id < 0 or self.eos_id < 0:
            raise ValueError(
                f"{model_path}: a T5 tokenizer needs pad and eos pieces (T5 layout: pad=0, eos=1, "
                f"unk=2, no bos) but this model has pad_id={self.pad_id}, eos_id={self.eos_id}, "
                f"unk_id={self.unk_id}, bos_id={self.bos_id}; train one with "
                "data_tools/train_tokenizer.py")
        # id of <extra_id_i>: counting down from the top of the vocabulary, as T5 does.
        self.sentinel_ids: List[int] = [self.vocab_size - 1 - i for i in range(self.extra_ids)]
        self._sentinel_by_piece: Dict[str, int] = {
            SENTINEL_FORMAT.format(i): tid for i, tid in enumerate(self.sentinel_ids)}
        clash = [p for p in self._sentinel_by_piece if sp.piece_to_id(p) != self.unk_id]
        if clash:
            raise ValueError(f"{model_path}: the model already has sentinel pieces ({clash[0]}, "
                             "...); they would get two ids")
        # Special strings matched in raw text, as HF does with its added tokens.
        self._special_by_piece: Dict[str, int] = dict(self._sentinel_by_piece)
        own = {sp.id_to_piece(tid): tid for tid in (self.pad_id, self.eos_id, self.unk_id)}
        self._special_by_piece.update(own)
        self._special_ids = frozenset(self._special_by_piece.values())
        # One generic pattern for all sentinels (a 100-way alternation compiles slowly and grows
        # with extra_ids); a match that is no sentinel here (<extra_id_100> with 100 extra ids)
        # stays text. No leading zeros: HF leaves <extra_id_01> as text too. Longest first, so
        # that no special piece is cut short by another that is its prefix.
        alternatives = [r"<extra_id_(?:0|[1-9][0-9]*)>"] + [
            re.escape(p) for p in sorted(own, key=len, reverse=True)]
        self._special_re = re.compile("|".join(alternatives))
        # Every special piece starts with "<" (checked here, not assumed): a text without "<" can
        # take the fast path with a single C-level substring test.
        self._trigger = "<" if all(p.startswith("<") for p in own) else None
        # Whether the normalizer adds a dummy "▁" in front of the text (T5: yes).
        self._dummy_prefix = sp.normalize("a").startswith(_SPACE)
        # id -> byte value of the byte-fallback pieces <0x00> .. <0xFF> (none without them).
        self._byte_values: Dict[int, int] = {}
        for value in range(256):
            tid = sp.piece_to_id(f"<0x{value:02X}>")
            if tid != self.unk_id and sp.is_byte(tid):
                self._byte_values[tid] = value

    # -- ids and pieces -----------------------------------------------------------------------

    @property
    def decoder_start_token_id(self) -> int:
        """First decoder input of T5: the pad id, as in HF's T5 config."""
        return self.pad_id

    def is_sentinel(self, token_id: int) -> bool:
        """Whether ``token_id`` is one of the ``extra_ids`` sentinels."""
        return self.sp_vocab_size <= token_id < self.vocab_size

    def id_to_piece(self, token_id: int) -> str:
        """Piece of ``token_id``; sentinels give ``<extra_id_i>``."""
        token_id = int(token_id)
        if 0 <= token_id < self.sp_vocab_size:
            return self._sp.id_to_piece(token_id)
        if self.sp_vocab_size <= token_id < self.vocab_size:
            return SENTINEL_FORMAT.format(self.vocab_size - 1 - token_id)
        raise IndexError(f"token id {token_id} out of range [0, {self.vocab_size})")

    def piece_to_id(self, piece: str) -> int:
        """Id of ``piece``, sentinels included; an unknown piece gives ``unk_id`` (as HF does)."""
        tid = self._sentinel_by_piece.get(piece)
        return tid if tid is not None else self._sp.piece_to_id(piece)

    @functools.cached_property
    def vocab(self) -> Dict[str, int]:
        """piece -> id over the whole vocabulary (built on first use)."""
        out = {self._sp.id_to_piece(i): i for i in range(self.sp_vocab_size)}
        out.update(self._sentinel_by_piece)
        return out

    @functools.cached_property
    def inv_vocab(self) -> Dict[int, str]:
        """id -> piece over the whole vocabulary (built on first use)."""
        return {i: p for p, i in self.vocab.items()}

    def word_start_mask(self) -> np.ndarray:
        """bool[vocab_size]: the piece starts a word (SentencePiece's ``▁``); sentinels do not.
        For ``--whole-word-masking``."""
        mask = np.zeros(self.vocab_size, dtype=bool)
        for i in range(self.sp_vocab_size):
            mask[i] = self._sp.id_to_piece(i).startswith(_SPACE)
        return mask

    # -- encoding -----------------------------------------------------------------------------

    def _split(self, text: str) -> Optional[Tuple[List[str], List[int]]]:
        """None if ``text`` has no special-token string, else (the n+1 texts around them, their
        n ids)."""
        if self._trigger is not None and self._trigger not in text:
            return None  # fast path: no special token can occur
        segments: List[str] = []
        ids: List[int] = []
        pos = 0
        for m in self._special_re.finditer(text):
            tid = self._special_by_piece.get(m.group())
            if tid is not None:
                segments.append(text[pos:m.start()])
                ids.append(tid)
                pos = m.end()
        if not ids:
            return None
        segments.append(text[pos:])
        return segments, ids

    def encode(self, text: str, add_eos: bool = False) -> List[int]:
        """Token ids of ``text``; literal special-token strings become their ids (module doc)."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, not {type(text).__name__}")
        split = self._split(text)
        if split is None:
            ids = self._sp.encode(text)
        else:
            segments, special = split
            encoded = self._sp.encode(segments, num_threads=1)
            ids = list(encoded[0])
            for tid, seg_ids in zip(special, encoded[1:]):
                ids.append(tid)
                ids.extend(seg_ids)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def encode_batch(self, texts: Sequence[str], add_eos: bool = False,
                     num_threads: Optional[int] = None) -> List[List[int]]:
        """``[encode(t, add_eos) for t in texts]``, with SentencePiece's threads (no GIL held).

        ``num_threads=None`` uses the CPUs this process may run on.
        """
        texts = list(texts)
        for t in texts:
            if not isinstance(t, str):
                raise TypeError(f"encode_batch expects str items, not {type(t).__name__}")
        if num_threads is None:
            num_threads = available_cpus()
        num_threads = max(1, min(int(num_threads), len(texts) or 1))
        splits = [self._split(t) for t in texts]
        if not any(splits):
            out = self._sp.encode(texts, num_threads=num_threads)
        else:
            # One SentencePiece call over plain texts and the segments of the others, so that all
            # of it runs threaded; then put the special ids back between the segments.
            flat: List[str] = []
            for t, split in zip(texts, splits):
                flat.extend([t] if split is None else split[0])
            enc = self._sp.encode(flat, num_threads=num_threads)
            out = []
            pos = 0
            for split in splits:
                ids = enc[pos]
                pos += 1
                if split is not None:
                    ids = list(ids)
                    for tid in split[1]:
                        ids.append(tid)
                        ids.extend(enc[pos])
                        pos += 1
                out.append(ids)
        if add_eos:
            for ids in out:
                ids.append(self.eos_id)
        return out

    def tokenize(self, text: str) -> List[int]:
        """Megatron's name for ``encode(text)``."""
        return self.encode(text)

    # -- decoding -----------------------------------------------------------------------------

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``, as the tokenizer.json of our Hugging Face export decodes them
        (megatron/checkpoint/formats/hf_tokenizer.py; lm_eval's hf backend decodes generations
        with it).

        Special tokens (sentinels, pad, eos, unk) are written as their strings (``<extra_id_0>``,
        ``</s>``, ...) with no space added around them, the text after one keeping the space its
        first piece starts with; with ``skip_special_tokens`` they are left out. The default
        keeps them, as transformers' ``decode``, Megatron's ``detokenize`` and our CPM-2
        tokenizer do: a span-corruption target reads ``<extra_id_0> text <extra_id_1> ...``.
        Byte pieces are decoded to the characters they spell (transformers' own T5Tokenizer has
        no byte pieces). Where SentencePiece's own decoding differs, for ids a model generates
        rather than ids of an encoded text, the export's is followed: a run of byte pieces that
        is no UTF-8 gives one U+FFFD per byte, and only the first token loses its "▁"
        (SentencePiece drops every leading space: "▁", "▁A" is " A" here, "A" there).

        Raises:
            ValueError: an id outside [0, vocab_size).
        """
        ids = self.checked_ids(ids)
        specials = self._special_ids
        sp_size = self.sp_vocab_size
        byte_values = self._byte_values
        plain = not any(i >= sp_size or i in specials or i in byte_values for i in ids)
        if plain and (not ids or self._sp.id_to_piece(ids[0]).strip(_SPACE)):
            # SentencePiece's decoding is the export's here, and faster: it differs only when
            # the text starts with a bare "▁" piece.
            return self._sp.decode(ids)
        return self._decode_tokens(ids, skip_special_tokens)

    def _decode_tokens(self, ids: List[int], skip_special_tokens: bool) -> str:
        """tokenizer.json's decoders on the ids' tokens: ByteFallback (each run of byte pieces
        as its UTF-8 text, or U+FFFD per byte), then Metaspace ("▁" to a space, none kept in the
        first token when the model adds a dummy prefix). Skipped special tokens are left out
        before, so byte pieces on both sides of one form one run."""
        tokens: List[str] = []
        run: List[int] = []

        def flush():
            if run:
                try:
                    tokens.append(bytes(run).decode("utf-8"))
                except UnicodeDecodeError:
                    tokens.extend("\ufffd" * len(run))
                run.clear()

        for i in ids:
            value = self._byte_values.get(i)
            if value is not None:
                run.append(value)
            elif i >= self.sp_vocab_size or i in self._special_ids:
                if not skip_special_tokens:
                    flush()
                    tokens.append(self.id_to_piece(i))
            else:
                flush()
                tokens.append(self._sp.id_to_piece(i))
        flush()
        if tokens and self._dummy_prefix:
            tokens[0] = tokens[0].replace(_SPACE, "")
        return "".join(tokens).replace(_SPACE, " ")

    def detokenize(self, ids: Iterable[int]) -> str:
        """Megatron's name for ``decode(ids)``."""
        return self.decode(ids)

    def normalize(self, text: str) -> str:
        """``text`` as SentencePiece's normalizer sees it, as plain text.

        For text without special-token strings, ``decode(encode(text)) == normalize(text)`` with a
        byte-fallback model (or any text whose characters are all in the vocabulary).
        """
        norm = self._sp.normalize(text).replace(_SPACE, " ")
        if self._dummy_prefix and norm.startswith(" "):
            norm = norm[1:]
        return norm

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.model_path!r}, extra_ids={self.extra_ids}): "
                f"vocab_size={self.vocab_size}, pad={self.pad_id}, eos={self.eos_id}, "
                f"unk={self.unk_id}")


SentencePieceTokenizer = T5Tokenizer


# -- choosing the tokenizer type ------------------------------------------------------------------

TOKENIZER_TYPES = ("SentencePieceTokenizer", "CPM2Tokenizer")
CPM2_VOCAB_NAME = "vocab.txt"


class TokenizerSpec(NamedTuple):
    """A tokenizer type and its file: a SentencePiece ``.model`` or a CPM-2 ``vocab.txt``."""

    tokenizer_type: str
    path: str


def resolve_tokenizer(path: Optional[str] = None, tokenizer_type: Optional[str] = None,
                      vocab_file: Optional[str] = None,
                      path_flag: str = "--tokenizer-model") -> TokenizerSpec:
    """The tokenizer that the flags name (nothing is loaded).

    path: ``--tokenizer-model``/``--tokenizer-path``: a SentencePiece ``.model``, a CPM-2
        ``vocab.txt`` (any ``*.txt``), or a folder holding one of them (CPM-2's ``bpe_cn``).
    tokenizer_type: ``--tokenizer-type``; None infers it from the file.
    vocab_file: ``--vocab-file``: a CPM-2 ``vocab.txt`` (Megatron's flag for vocabulary files).
    path_flag: how messages name ``path``.

    Raises:
        ValueError: naming the flag and the file: none or both of path and vocab_file, no such
            file, a folder holding neither or both kinds, a type that contradicts the file.
    """
    if tokenizer_type is not None and tokenizer_type not in TOKENIZER_TYPES:
        raise ValueError(f"--tokenizer-type {tokenizer_type}: choose one of "
                         f"{', '.join(TOKENIZER_TYPES)}")
    if vocab_file is not None:
        if path is not None:
            raise ValueError(f"give {path_flag} or --vocab-file, not both")
        if tokenizer_type == "SentencePieceTokenizer":
            raise ValueError("--vocab-file is a CPM-2 vocab.txt: it goes with --tokenizer-type "
                             "CPM2Tokenizer (a SentencePiece model goes to --tokenizer-model)")
        if not os.path.isfile(vocab_file):
            raise ValueError(f"--vocab-file {vocab_file}: no such file")
        return TokenizerSpec("CPM2Tokenizer", os.fspath(vocab_file))
    if path is None:
        raise ValueError(f"{path_flag} is required (a SentencePiece .model, a CPM-2 vocab.txt "
                         "or a folder holding one), or --tokenizer-type CPM2Tokenizer "
                         "--vocab-file vocab.txt")
    if os.path.isdir(path):
        return _resolve_folder(os.fspath(path), tokenizer_type, path_flag)
    if not os.path.isfile(path):
        raise ValueError(f"{path_flag} {path}: no such file")
    inferred = "CPM2Tokenizer" if str(path).endswith(".txt") else "SentencePieceTokenizer"
    return TokenizerSpec(tokenizer_type or inferred, os.fspath(path))


def _resolve_folder(path: str, tokenizer_type: Optional[str], path_flag: str) -> TokenizerSpec:
    models = sorted(str(p) for p in Path(path).glob("*.model"))
    vocab = os.path.join(path, CPM2_VOCAB_NAME)
    has_vocab = os.path.isfile(vocab)
    if tokenizer_type == "CPM2Tokenizer" or (tokenizer_type is None and has_vocab and
                                             not models):
        if not has_vocab:
            raise ValueError(f"{path_flag} {path}: --tokenizer-type CPM2Tokenizer needs the "
                             f"folder's {CPM2_VOCAB_NAME}; there is none")
        return TokenizerSpec("CPM2Tokenizer", vocab)
    if tokenizer_type is None and has_vocab:
        raise ValueError(f"{path_flag} {path}: the folder holds both a CPM-2 {CPM2_VOCAB_NAME} "
                         f"and SentencePiece *.model files; name the file, or give "
                         "--tokenizer-type")
    if len(models) != 1:
        what = "exactly one SentencePiece *.model file" if tokenizer_type else \
            f"a CPM-2 {CPM2_VOCAB_NAME} or exactly one SentencePiece *.model file"
        raise ValueError(f"{path_flag} {path}: a folder must hold {what}; found "
                         f"{len(models)} *.model files")
    return TokenizerSpec("SentencePieceTokenizer", models[0])


def build_tokenizer(spec: TokenizerSpec, extra_ids: int = 100):
    """The tokenizer of ``spec``: ``T5Tokenizer`` (with ``extra_ids`` sentinels) or
    ``CPM2Tokenizer`` (its sentinels are the vocabulary's ``<s_N>``; ``extra_ids`` does not
    apply). Both have the interface the data tools, the datasets and training use.

    Raises:
        ValueError: the file cannot be that tokenizer's (the message names it).
        ImportError: CPM2Tokenizer without jieba installed.
    """
    if spec.tokenizer_type == "CPM2Tokenizer":
        from megatron.data.tokenizers.cpm2_tokenizer import CPM2Tokenizer

        return CPM2Tokenizer(spec.path)
    return T5Tokenizer(spec.path, extra_ids=extra_ids)


__all__ = ["T5Tokenizer", "SentencePieceTokenizer", "SENTINEL_FORMAT", "TOKENIZER_TYPES",
           "TokenizerSpec", "resolve_tokenizer", "build_tokenizer"]
