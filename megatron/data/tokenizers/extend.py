"""Vocabulary extension (CPM-2's bilingual stage): an old vocabulary with new pieces after it, and
which old token's embedding row each token of the extended vocabulary starts from.

Two vocabulary kinds, laid out as their tokenizers read them:

* a SentencePiece model (``T5Tokenizer``): the old model's pieces keep their ids, the new pieces
  follow as ordinary pieces, and T5's sentinels stay on top of the whole vocabulary
  (``id(<extra_id_i>) = sp_size + 99 - i``), so every sentinel id grows by the number of pieces
  added;
* a CPM-2 ``vocab.txt`` (``CPM2Tokenizer``): the old lines up to the first sentinel keep their
  ids, the new pieces follow, the old sentinels ``<s_0>``, ``<s_1>``, ... come last, in their
  order: Chinese first, English after, sentinels last, as CPM-2-Finetune's ``bpe_cn_en``.
  (``bpe_cn_en`` itself is not ``bpe_cn`` plus pieces with ids unchanged: it inserts ``<go>`` at
  id 7, shifting every later Chinese id by one, and keeps 185 of ``bpe_cn``'s 190 sentinels.)

``row_sources`` maps the tokens of an extended vocabulary to the old one by their piece strings:
an old token keeps its row (sentinels and special tokens move with their ids), a new token takes
the row of its longest prefix that is an ordinary old token (SentencePiece's ``▁`` is part of the
piece; the paper's "the embeddings of their prefixes"), else the row of a seeded random ordinary
old token. Special pieces (``<...>``: pad, eos, unk, byte pieces, sentinels) are no prefixes and
no random choices.

No torch: the data tools import this cheaply.
"""

from __future__ import annotations

import re
from typing import Dict, Iterable, List, NamedTuple, Sequence, Tuple

import numpy as np

from megatron.data.tokenizers.cpm2_tokenizer import SENTINEL_FORMAT as CPM2_SENTINEL_FORMAT
from megatron.data.tokenizers.cpm2_tokenizer import has_chinese

SPACE = "\u2581"  # SentencePiece's word-start "▁"
DEFAULT_SEED = 1234
_SPECIAL_RE = re.compile(r"<[^<>\s]+>")
_CPM2_SENTINEL_RE = re.compile(r"<s_(0|[1-9][0-9]*)>")


class VocabularyExtensionError(ValueError):
    """The vocabularies cannot be extended or mapped; the message names the file and piece."""


# -- SentencePiece models ---------------------------------------------------------------------

def load_model_proto(path: str):
    """The ``ModelProto`` of a SentencePiece ``.model`` file."""
    from google.protobuf.message import DecodeError
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    try:
        with open(path, "rb") as f:
            proto.ParseFromString(f.read())
    except (OSError, DecodeError) as e:
        raise VocabularyExtensionError(f"{path}: not a SentencePiece model ({e})") from None
    if not proto.pieces:
        raise VocabularyExtensionError(f"{path}: not a SentencePiece model (no pieces)")
    return proto


def normal_pieces(proto) -> List[Tuple[str, float]]:
    """(piece, score) of the ordinary pieces of ``proto`` in id order (no control, unknown,
    byte, user-defined or unused pieces)."""
    normal = type(proto.pieces[0]).Type.Value("NORMAL")
    return [(p.piece, p.score) for p in proto.pieces if p.type == normal]


def extend_model_proto(old, new_pieces: Sequence[Tuple[str, float]]):
    """A copy of SentencePiece ``old`` with ``new_pieces`` ((piece, score), in order) appended as
    ordinary pieces; those already in ``old`` and ``<...>`` pieces (sentinel or special look-
    alikes) are left out. For a BPE model, whose scores are the merge order, the new pieces'
    scores are put below every old score (in their order), so that old merges come first.

    Returns: (the extended ModelProto, the pieces added).
    """
    proto = type(old)()
    proto.CopyFrom(old)
    have = {p.piece for p in old.pieces}
    added = []
    for piece, score in new_pieces:
        if piece in have or _SPECIAL_RE.fullmatch(piece) or not piece:
            continue
        have.add(piece)
        added.append((piece, float(score)))
    bpe = old.trainer_spec.model_type == type(old.trainer_spec).ModelType.Value("BPE")
    if bpe and added:
        floor = min(p.score for p in old.pieces)
        added = [(piece, floor - 1.0 - k) for k, (piece, _) in enumerate(added)]
    normal = type(old.pieces[0]).Type.Value("NORMAL")
    for piece, score in added:
        entry = proto.pieces.add()
        entry.piece, entry.score, entry.type = piece, score, normal
    proto.trainer_spec.vocab_size = len(proto.pieces)
    return proto, [piece for piece, _ in added]


def trainer_options_like(old) -> Dict[str, object]:
    """SentencePieceTrainer options that make new pieces the way ``old`` made its own: model
    type, normalization and the splitting rules (pieces compare as strings with the old ones)."""
    spec, norm = old.trainer_spec, old.normalizer_spec
    model_type = type(spec).ModelType.Name(spec.model_type).lower()
    if model_type not in ("unigram", "bpe"):
        raise VocabularyExtensionError(f"a {model_type} SentencePiece model cannot be extended "
                                       "(unigram or bpe only)")
    return dict(model_type=model_type, normalization_rule_name=norm.name or "nmt_nfkc",
                add_dummy_prefix=norm.add_dummy_prefix,
                remove_extra_whitespaces=norm.remove_extra_whitespaces,
                split_digits=spec.split_digits, split_by_whitespace=spec.split_by_whitespace,
                split_by_number=spec.split_by_number,
                split_by_unicode_script=spec.split_by_unicode_script,
                treat_whitespace_as_suffix=spec.treat_whitespace_as_suffix,
                max_sentencepiece_length=spec.max_sentencepiece_length or 16)


def vocab_lines(proto) -> List[str]:
    """The lines of SentencePiece's ``.vocab`` file for ``proto``: piece, tab, score."""
    return [f"{p.piece}\t{p.score:g}" for p in proto.pieces]


# -- CPM-2 vocab.txt ---------------------------------------------------------------------------

def cpm2_pieces_from_sentencepiece(pieces: Iterable[str]) -> List[str]:
    """CPM-2 word pieces from SentencePiece pieces, in order, without repeats: a word start
    ``▁word`` becomes ``word``; a piece inside a word becomes ``##piece`` when it has no Chinese
    character (CPM-2 looks such pieces up with ``##``), else stays as it is; ``▁`` alone and
    pieces with whitespace are dropped."""
    out, seen = [], set()
    for piece in pieces:
        if piece.startswith(SPACE):
            word = piece[len(SPACE):]
        else:
            word = piece if has_chinese(piece) else "##" + piece
        if not word or word == "##" or any(ch.isspace() for ch in word) or SPACE in word \
                or word in seen:
            continue
        seen.add(word)
        out.append(word)
    return out


def extend_cpm2_vocabulary(old: Sequence[str], new_pieces: Iterable[str],
                           path: str = "vocab.txt") -> Tuple[List[str], List[str]]:
    """CPM-2's layout: ``old``'s lines up to its first sentinel, the new pieces (those not in
    ``old``, no ``<...>`` pieces), then ``old``'s sentinels in their order.

    Returns: (the extended lines, the pieces added).
    Raises:
        VocabularyExtensionError: the sentinels of ``old`` are not its last lines.
    """
    first = next((i for i, p in enumerate(old) if _CPM2_SENTINEL_RE.fullmatch(p)), len(old))
    if any(not _CPM2_SENTINEL_RE.fullmatch(p) for p in old[first:]):
        raise VocabularyExtensionError(
            f"{path}: its sentinels ({CPM2_SENTINEL_FORMAT.format(0)}, ...) are not its last lines "
            "(CPM-2's layout); the new pieces would have no place before them")
    have = set(old)
    added = []
    for piece in new_pieces:
        if piece in have or _SPECIAL_RE.fullmatch(piece):
            continue
        have.add(piece)
        added.append(piece)
    return list(old[:first]) + added + list(old[first:]), added


# -- embedding rows ------------------------------------------------------------------------------

class RowPlan(NamedTuple):
    """For each id of the extended vocabulary: the old id whose row it starts from, and why."""

    source: List[int]   # old id per new id
    kind: List[str]     # "old" (the same token), "prefix" or "random"
    old_size: int
    new_size: int

    def new_id(self) -> Dict[int, int]:
        """old id -> its id in the extended vocabulary."""
        return {src: i for i, (src, kind) in enumerate(zip(self.source, self.kind))
                if kind == "old"}


def _pieces(tokenizer) -> List[str]:
    return [tokenizer.id_to_piece(i) for i in range(tokenizer.vocab_size)]


def row_sources(old, new, seed: int = DEFAULT_SEED, old_name: str = "the old tokenizer",
                new_name: str = "the new tokenizer") -> RowPlan:
    """The rows of the extended vocabulary (module doc). ``old`` and ``new``: tokenizers with
    ``vocab_size`` and ``id_to_piece`` (``T5Tokenizer``, ``CPM2Tokenizer``).

    Raises:
        VocabularyExtensionError: a piece of ``old`` is missing from ``new`` (``new`` is no
            extension of ``old``), or ``old`` has no ordinary piece.
    """
    old_pieces, new_pieces = _pieces(old), _pieces(new)
    old_ids = {p: i for i, p in enumerate(old_pieces)}
    new_set = set(new_pieces)
    missing = [(i, p) for i, p in enumerate(old_pieces) if p not in new_set]
    if missing:
        shown = ", ".join(f"{p!r} (id {i})" for i, p in missing[:3])
        raise VocabularyExtensionError(
            f"{new_name} is no extension of {old_name}: {len(missing)} of its pieces are "
            f"missing, e.g. {shown}")
    ordinary = {p: i for p, i in old_ids.items() if not _SPECIAL_RE.fullmatch(p)}
    if not ordinary:
        raise VocabularyExtensionError(f"{old_name} has no ordinary piece to start rows from")
    longest = max(map(len, ordinary))
    source, kind, need_random = [], [], []
    for i, piece in enumerate(new_pieces):
        if piece in old_ids:
            source.append(old_ids[piece])
            kind.append("old")
            continue
        prefix = next((piece[:k] for k in range(min(len(piece) - 1, longest), 0, -1)
                       if piece[:k] in ordinary), None)
        if prefix is not None and not _SPECIAL_RE.fullmatch(piece):
            source.append(ordinary[prefix])
            kind.append("prefix")
        else:
            source.append(-1)
            kind.append("random")
            need_random.append(i)
    candidates = np.array(sorted(ordinary.values()), dtype=np.int64)
    picks = np.random.default_rng(seed).choice(candidates, size=len(need_random))
    for i, pick in zip(need_random, picks):
        source[i] = int(pick)
    return RowPlan(source, kind, len(old_pieces), len(new_pieces))
