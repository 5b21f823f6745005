"""The tokenizer tools' corpus: the training sentences of JSONL or plain-text inputs, and what
both train_tokenizer.py and its `--extend` (extend_tokenizer.py) check and clean up.

`Corpus` streams the sentences of the files (never loaded whole): documents cut into lines,
lines longer than `--max-sentence-length` bytes cut at a space or CJK full stop, so that
SentencePiece drops nothing for being too long; it counts what it saw. Bad input raises
`InputError`, whose message names the file and line.
"""

from __future__ import annotations

import argparse
import gzip
import os
from typing import Iterator, List, Optional, Sequence

from megatron.data.preprocess.jsonl import JSONL_SUFFIXES, BadLine, parse_line, read_chunks

TEXT_SUFFIXES = (".txt", ".txt.gz")
# Preferred places to cut an over-long line: after a space, or after a CJK sentence end.
_CUT_AFTER = (b" ", "。".encode(), "！".encode(), "？".encode(), "；".encode(), "，".encode())


class InputError(Exception):
    """Unusable input; str() names the file (and line) and says what is wrong."""


def input_format(path: str, forced: str) -> str:
    """'jsonl' or 'text' for `path`."""
    if forced != "auto":
        return forced
    if path.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if path.endswith(TEXT_SUFFIXES):
        return "text"
    raise InputError(f"{path}: cannot tell the format from the name (expected one of "
                     f"{', '.join(JSONL_SUFFIXES + TEXT_SUFFIXES)}); use --input-format")


def check_readable(path: str) -> None:
    """Fail now, not after minutes of training, on a file that cannot be opened or decompressed."""
    try:
        with open(path, "rb") as f:
            if path.endswith(".gz"):
                with gzip.GzipFile(fileobj=f) as g:
                    g.read(1)
            else:
                f.read(1)
    except (OSError, EOFError) as e:
        raise InputError(f"{path}: cannot read: {e}") from None


def cut_line(line: str, max_bytes: int) -> Iterator[str]:
    """`line` in pieces of at most `max_bytes` UTF-8 bytes, cut after a space or CJK punctuation
    where one falls in the second half of the window, else at a character boundary."""
    data = line.encode("utf-8")
    while len(data) > max_bytes:
        cut = 0
        for sep in _CUT_AFTER:
            k = data.rfind(sep, max_bytes // 2, max_bytes - len(sep) + 1)
            if k >= 0:
                cut = max(cut, k + len(sep))
        if not cut:
            cut = max_bytes
            while data[cut] & 0xC0 == 0x80:  # back off to the start of a UTF-8 character
                cut -= 1
        piece = data[:cut].decode("utf-8").strip()
        if piece:
            yield piece
        data = data[cut:]
    piece = data.decode("utf-8").strip()
    if piece:
        yield piece


class Corpus:
    """Iterates the training sentences of `paths` and counts what it saw."""

    def __init__(self, paths: List[str], args: argparse.Namespace):
        self.paths = paths
        self.formats = [input_format(p, args.input_format) for p in paths]
        self.keys = list(args.json_keys)
        self.max_docs = args.max_docs
        self.max_bytes = args.max_sentence_length
        self.skip_bad = args.skip_bad_lines
        self.docs = self.sentences = self.cut = self.bad = self.boms = 0
        self.bad_examples: List[str] = []
        self.error: Optional[InputError] = None  # set when the iteration stopped on bad input

    def _texts(self, line: bytes, fmt: str) -> List[str]:
        if fmt == "text":
            try:
                return [line.decode("utf-8")]
            except UnicodeDecodeError as e:
                raise ValueError(f"invalid UTF-8 at byte {e.start}") from None
        try:
            return parse_line(line, self.keys, allow_empty=True)
        except BadLine as e:
            raise ValueError(str(e)) from None

    def __iter__(self) -> Iterator[str]:
        try:
            yield from self._sentences()
        except InputError as e:
            # SentencePiece turns an exception in its iterator into a RuntimeError with the
            # traceback in the message; keep ours to report it cleanly.
            self.error = e
            raise

    def _sentences(self) -> Iterator[str]:
        try:
            for chunk in read_chunks(self.paths):
                path, fmt = self.paths[chunk.file_index], self.formats[chunk.file_index]
                self.boms += chunk.bom
                for k, line in enumerate(chunk.lines):
                    if self.max_docs and self.docs >= self.max_docs:
                        return
                    try:
                        texts = self._texts(line, fmt)
                    except ValueError as e:
                        where = f"{path}:{chunk.first_line + k}: {e}"
                        if not self.skip_bad:
                            raise InputError(where + " (--skip-bad-lines to skip such lines)")
                        self.bad += 1
                        if len(self.bad_examples) < 5:
                            self.bad_examples.append(where)
                        continue
                    if not any(t.strip() for t in texts):
                        continue  # blank line or empty document: nothing to learn from
                    self.docs += 1
                    for text in texts:
                        for sent in text.splitlines():
                            if len(sent) * 4 > self.max_bytes and \
                                    len(sent.encode("utf-8")) > self.max_bytes:
                                self.cut += 1
                                pieces = cut_line(sent, self.max_bytes)
                            else:
                                sent = sent.strip()
                                pieces = (sent,) if sent else ()
                            for piece in pieces:
                                self.sentences += 1
                                yield piece
        except OSError as e:  # a read error mid-file (e.g. truncated gzip); the message names it
            raise InputError(str(e)) from None


def remove(paths: Sequence[str]) -> None:
    """Delete `paths` where they exist (a failed run's temporaries)."""
    for path in paths:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
