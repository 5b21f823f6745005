"""CPM-2's tokenizer: a `vocab.txt` (CPM-2-Pretrain's `bpe_cn`, `bpe_cn_en`) with jieba words.

Gives the ids of CPM-2-Pretrain's `EncDecTokenizer` (`src/tokenization_enc_dec.py`), so corpora
tokenized by CPM-2 and corpora tokenized here are the same data. The rules, restated:

1. Full-width to half-width: U+3000 becomes a space and U+FF00..U+FF5E become U+0020..U+007E,
   except the kept punctuation ，！（）？；： (。 and 、 lie outside that range and stay as well).
2. jieba (precise mode, with its HMM for unknown words) cuts the text into words; whitespace
   characters come out one per word.
3. In each word a space becomes `▂` and a newline `▃`; then greedy longest-match word pieces
   over the vocabulary: a piece that contains a Chinese character (U+4E00..U+9FFF) is looked up
   as it is, any other piece after the first of its word as `##piece`. A character no piece
   covers becomes `<unk>` (and the search goes on at the next character); a word longer than
   200 characters is one `<unk>`.
4. A `▂` between two pieces that both have no Chinese character (English words, digits,
   punctuation, `▃`, `<unk>`, ...) is dropped: English word boundaries are implied.

`decode` is CPM-2's: pieces back to back, a space put between any two pieces that both have no
Chinese character, `▂`/`▃` back to space/newline. It is not an exact inverse (step 1 and step 4
lose information; `##` pieces keep their `##`). Literal special strings in the text (`<eod>`,
`<s_0>`) are not special: jieba cuts them like any text, as in CPM-2.

The special ids come from the vocabulary: `<eod>` (end of document, Megatron's `eod`), `<pad>`,
`<unk>`, `<s>` (CPM-2's decoder start, id 1) and the sentinels `<s_0>`, `<s_1>`, ... (190 in
`bpe_cn`, ids 26050..26239; 185 in `bpe_cn_en`). The vocabulary size is its number of lines.

Where CPM-2's code does something else (we chose not to follow it):

* Empty text: theirs raises IndexError; ours gives []. Text that makes one token (a single
  character, one space, one newline): theirs returns that token twice (`encode` keeps the first
  and the last token, which are then the same one); ours returns it once. Their preprocessing
  drops documents under 10 tokens, so their corpora hold no such case. `decode([])` gives "".
* The space token: theirs hard-codes id 10, which is `▂` in `bpe_cn` but `,` in `bpe_cn_en`
  (where `▂` is 11), so there it drops commas between English pieces, keeps the spaces, and its
  decode inserts commas. Ours uses the id of `▂` in the vocabulary, and decode inserts spaces.
* Sentinels: theirs requires exactly `<s_0>`..`<s_189>` (so `bpe_cn_en`, with 185, fails to
  load); ours takes every `<s_N>` of the vocabulary, which must run from `<s_0>` without a gap.
* A vocabulary line that repeats an earlier one is refused (theirs maps it to its last line
  and its vocabulary size then undercounts the ids).
* `tokenize` is Megatron's name for `encode` (ids); theirs returns (and prints) the pieces.

jieba is imported when a tokenizer is made (a clear ImportError names the package when it is
missing) and loads its dictionary at the first `encode` (about 0.5 s; its first use on a machine
also writes its cache file `jieba.cache` to the temporary folder). Speed: jieba's cut is most of
the cost; `megatron.data.tokenizers.jieba_segmenter` gives its words faster, and the word pieces are cached
per word (see bench/RESULTS.md, section "cpm2_tokenizer").
"""

from __future__ import annotations

import functools
import logging
import os
import re
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from megatron.data.tokenizers.jieba_segmenter import JiebaSegmenter
from megatron.data.tokenizers.tokenizer_names import TokenizerNames

SENTINEL_FORMAT = "<s_{}>"
SPACE_PIECE = "\u2582"    # "▂"
NEWLINE_PIECE = "\u2583"  # "▃"
MAX_WORD_CHARS = 200
REQUIRED_PIECES = ("<unk>", "<pad>", "<eod>", "<s>")
_WORD_CACHE_SIZE = 1 << 18  # words whose pieces are remembered (cleared when full)

_KEPT_FULL_WIDTH = "，！（）？；："
# U+FF00..U+FF5E -> U+0020..U+007E (U+FF00 is unassigned; CPM-2 maps it as well) and U+3000.
_FULL_TO_HALF = {c: c - 0xFEE0 for c in range(0xFF00, 0xFF5F) if chr(c) not in _KEPT_FULL_WIDTH}
_FULL_TO_HALF[0x3000] = 0x20
_SPACES_TO_PIECES = str.maketrans({" ": SPACE_PIECE, "\n": NEWLINE_PIECE})
_SENTINEL_RE = re.compile(r"<s_(0|[1-9][0-9]*)>")
_SPECIAL_RE = re.compile(r"</?[a-z_0-9]+>")


class CPM2VocabularyError(ValueError):
    """The vocab.txt cannot be CPM-2's: the message names the file and what is missing."""


def has_chinese(piece: str) -> bool:
    """CPM-2's test for a Chinese piece: any character in U+4E00..U+9FFF."""
    return any("\u4e00" <= ch <= "\u9fff" for ch in piece)


def load_vocabulary(path: str) -> List[str]:
    """The pieces of a CPM-2 vocab.txt, one per line (stripped, as CPM-2 reads them); line i
    is id i.

    Raises:
        CPM2VocabularyError: no such file, not UTF-8, a repeated line, or one of `<unk>`,
            `<pad>`, `<eod>`, `<s>`, `<s_0>` missing (or sentinels with a gap).
    """
    if not os.path.isfile(path):
        raise CPM2VocabularyError(f"{path}: no such CPM-2 vocabulary file (vocab.txt)")
    try:
        with open(path, encoding="utf-8") as f:
            pieces = [line.strip() for line in f]
    except UnicodeDecodeError as e:
        raise CPM2VocabularyError(f"{path}: not a UTF-8 text file ({e}); a CPM-2 vocab.txt "
                                  "has one piece per line") from None
    seen: Dict[str, int] = {}
    for i, piece in enumerate(pieces):
        if piece in seen:
            raise CPM2VocabularyError(f"{path}: line {i + 1} repeats line {seen[piece] + 1} "
                                      f"({piece!r}); every piece must have one id")
        seen[piece] = i
    missing = [p for p in REQUIRED_PIECES if p not in seen]
    numbers = sorted(int(m.group(1)) for p in seen for m in [_SENTINEL_RE.fullmatch(p)] if m)
    if not numbers or numbers[0] != 0:
        missing.append("the sentinels <s_0>, <s_1>, ...")
    else:
        gap = next((i for i, n in enumerate(numbers) if n != i), None)
        if gap is not None:
            missing.append(f"{SENTINEL_FORMAT.format(gap)} (the sentinels must run from <s_0> "
                           f"without a gap; <s_{numbers[-1]}> is there)")
    if missing:
        raise CPM2VocabularyError(
            f"{path}: not a CPM-2 vocabulary ({len(pieces)} lines): missing "
            f"{', '.join(missing)}. CPM-2's bpe_cn/vocab.txt has <unk>, <s>, <pad>, <eod> and "
            "the sentinels <s_0> ... <s_189>, one piece per line")
    return pieces


def _import_jieba():
    try:
        # jieba: an optional dependency (the 'cpm2' extra), needed only for CPM-2's vocab.txt
        import jieba
    except ImportError:
        raise ImportError("CPM-2's tokenizer (a vocab.txt) cuts words with jieba, which is not "
                          "installed: pip install jieba (or pip install -e '.[cpm2]')") from None
    return jieba


class CPM2Tokenizer(TokenizerNames):
    """CPM-2-Pretrain's `EncDecTokenizer` ids from a vocab.txt (module doc); the interface of
    `megatron.data.tokenizers.tokenizer.T5Tokenizer`."""

    def __init__(self, vocab_file: str):
        """Load `vocab_file` (CPM-2's `bpe_cn/vocab.txt` or one like it).

        Raises:
            CPM2VocabularyError: see `load_vocabulary`.
            ImportError: jieba is not installed.
        """
        self.vocab_file = os.fspath(vocab_file)
        self._pieces = load_vocabulary(self.vocab_file)
        self._jieba_module = _import_jieba()
        self._ids: Dict[str, int] = {p: i for i, p in enumerate(self._pieces)}
        self.vocab_size: int = len(self._pieces)
        self.unk_id: int = self._ids["<unk>"]
        self.pad_id: int = self._ids["<pad>"]
        self.eos_id: int = self._ids["<eod>"]
        self.bos_id: int = self._ids["<s>"]
        self.sentinel_ids: List[int] = []
        while SENTINEL_FORMAT.format(len(self.sentinel_ids)) in self._ids:
            self.sentinel_ids.append(self._ids[SENTINEL_FORMAT.format(len(self.sentinel_ids))])
        self._sentinel_set = frozenset(self.sentinel_ids)
        self._space_id: Optional[int] = self._ids.get(SPACE_PIECE)
        # Pieces without a Chinese character, except ▂: "English" in CPM-2's space rules.
        self._english: List[bool] = [not has_chinese(p) for p in self._pieces]
        if self._space_id is not None:
            self._english[self._space_id] = False
        self._longest = max(len(p) for p in self._pieces)
        self._jieba = None  # made at the first encode
        self._word_cache: Dict[str, Tuple[int, ...]] = {}

    # -- ids and pieces -----------------------------------------------------------------------

    @property
    def decoder_start_token_id(self) -> int:
        """First decoder input: `<s>` (id 1 in CPM-2's vocabularies, as CPM-2 hard-codes it)."""
        return self.bos_id

    def is_sentinel(self, token_id: int) -> bool:
        """Whether `token_id` is one of the `<s_N>` sentinels."""
        return int(token_id) in self._sentinel_set

    def id_to_piece(self, token_id: int) -> str:
        """The vocabulary line of `token_id`."""
        token_id = int(token_id)
        if not 0 <= token_id < self.vocab_size:
            raise IndexError(f"token id {token_id} out of range [0, {self.vocab_size})")
        return self._pieces[token_id]

    def piece_to_id(self, piece: str) -> int:
        """Id of `piece`; an unknown piece gives `unk_id`."""
        return self._ids.get(piece, self.unk_id)

    @property
    def vocab(self) -> Dict[str, int]:
        """piece -> id over the whole vocabulary."""
        return dict(self._ids)

    @functools.cached_property
    def inv_vocab(self) -> Dict[int, str]:
        """id -> piece over the whole vocabulary."""
        return dict(enumerate(self._pieces))

    @functools.cached_property
    def special_ids(self) -> frozenset:
        """Ids of the `<...>` pieces (`<unk>`, `<s>`, `<pad>`, `<eod>`, the sentinels, ...)."""
        return frozenset(i for i, p in enumerate(self._pieces) if _SPECIAL_RE.fullmatch(p))

    def word_start_mask(self) -> np.ndarray:
        """bool[vocab_size]: the piece starts a word (it is no `##` continuation); for
        `--whole-word-masking`. In `bpe_cn`, which has no `##` pieces, every piece does."""
        return np.array([not p.startswith("##") for p in self._pieces], dtype=bool)

    # -- encoding -----------------------------------------------------------------------------

    def normalize(self, text: str) -> str:
        """`text` after CPM-2's full-width to half-width mapping (step 1 of the module doc)."""
        return text.translate(_FULL_TO_HALF)

    def _cut(self):
        """jieba's precise-mode cut (text -> list of words), made at the first use."""
        if self._jieba is None:
            # Our own jieba.Tokenizer: words added to jieba's global one elsewhere do not count.
            jieba_tokenizer = self._jieba_module.Tokenizer()
            log = logging.getLogger("jieba")  # its start-up lines would come from every worker
            level = log.level
            log.setLevel(logging.WARNING)
            try:
                jieba_tokenizer.initialize()
            finally:
                log.setLevel(level)
            self._jieba = JiebaSegmenter(self._jieba_module, jieba_tokenizer)
        return self._jieba.cut

    def warm_up(self) -> None:
        """Load jieba's dictionary now rather than at the first `encode` (e.g. once in a parent
        process before it forks workers)."""
        self._cut()

    def _word_ids(self, word: str) -> Tuple[int, ...]:
        """Greedy longest-match pieces of one jieba word whose spaces are already `▂`/`▃`."""
        n = len(word)
        if n > MAX_WORD_CHARS:
            return (self.unk_id,)
        han = [0] * (n + 1)  # han[j]: Chinese characters in word[:j]
        for j, ch in enumerate(word):
            han[j + 1] = han[j] + ("\u4e00" <= ch <= "\u9fff")
        ids = self._ids
        out = []
        start = 0
        while start < n:
            # No piece is longer than the longest line, so longer candidates cannot match.
            end = min(n, start + self._longest)
            found = None
            while end > start:
                sub = word[start:end]
                if start > 0 and han[end] == han[start]:
                    sub = "##" + sub
                found = ids.get(sub)
                if found is not None:
                    break
                end -= 1
            if found is None:
                out.append(self.unk_id)
                start += 1
            else:
                out.append(found)
                start = end
        return tuple(out)

    def _drop_spaces(self, ids: List[int]) -> List[int]:
        """CPM-2's step 4: drop each `▂` whose neighbours (before any drop) are both English;
        the first and the last token are always kept."""
        space, n = self._space_id, len(ids)
        if space is None or n < 3:
            return ids
        english = self._english
        drop = []
        i = 1
        while True:
            try:
                i = ids.index(space, i, n - 1)
            except ValueError:
                break
            if english[ids[i - 1]] and english[ids[i + 1]]:
                drop.append(i)
            i += 1
        if not drop:
            return ids
        out: List[int] = []
        prev = 0
        for i in drop:
            out += ids[prev:i]
            prev = i + 1
        out += ids[prev:]
        return out

    def encode(self, text: str, add_eos: bool = False) -> List[int]:
        """CPM-2's ids of `text` (module doc), with `<eod>` appended if `add_eos`."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, not {type(text).__name__}")
        cut = self._cut()
        cache = self._word_cache
        ids: List[int] = []
        for word in cut(text.translate(_FULL_TO_HALF)):
            pieces = cache.get(word)
            if pieces is None:
                pieces = self._word_ids(word.translate(_SPACES_TO_PIECES))
                if len(cache) >= _WORD_CACHE_SIZE:
                    cache.clear()
                cache[word] = pieces
            ids += pieces
        ids = self._drop_spaces(ids)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def encode_batch(self, texts: Sequence[str], add_eos: bool = False,
                     num_threads: Optional[int] = None) -> List[List[int]]:
        """`[encode(t, add_eos) for t in texts]`. jieba is pure Python (it holds the GIL), so
        `num_threads` is accepted and ignored: use processes (preprocess_data.py --workers)."""
        return [self.encode(t, add_eos) for t in texts]

    def tokenize(self, text: str) -> List[int]:
        """Megatron's name for `encode(text)`."""
        return self.encode(text)

    # -- decoding -----------------------------------------------------------------------------

    @functools.cached_property
    def _texts(self) -> List[str]:
        return [p.replace(SPACE_PIECE, " ").replace(NEWLINE_PIECE, "\n") for p in self._pieces]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """CPM-2's text of `ids` (module doc). With `skip_special_tokens`, the `<...>` pieces
        (`<unk>`, `<pad>`, `<eod>`, sentinels, ...) are left out first; by default they are
        written, as CPM-2 does.

        Raises:
            ValueError: an id outside [0, vocab_size).
        """
        ids = self.checked_ids(ids)
        if skip_special_tokens:
            special = self.special_ids
            ids = [i for i in ids if i not in special]
        if not ids:
            return ""
        english, texts = self._english, self._texts
        out = []
        for a, b in zip(ids, ids[1:]):
            out.append(texts[a])
            if english[a] and english[b]:
                out.append(" ")
        out.append(texts[ids[-1]])
        return "".join(out)

    def detokenize(self, ids: Iterable[int]) -> str:
        """Megatron's name for `decode(ids)`."""
        return self.decode(ids)

    # -- pickling: jieba's dictionary is loaded again where the copy is used -------------------

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_jieba"] = None
        state["_word_cache"] = {}
        state.pop("_jieba_module")
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._jieba_module = _import_jieba()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.vocab_file!r}): vocab_size={self.vocab_size}, "
                f"pad={self.pad_id}, eod={self.eos_id}, unk={self.unk_id}, "
                f"decoder_start={self.bos_id}, sentinels={len(self.sentinel_ids)}")


__all__ = ["CPM2Tokenizer", "CPM2VocabularyError", "SENTINEL_FORMAT", "load_vocabulary"]
