"""Streaming JSONL input for the offline tools: files, globs, gzip, chunks of lines, bad lines.

Input is read as bytes in chunks of whole lines, never a whole file at once, so memory stays bounded
whatever the corpus size. Parsing is separate (`parse_line`) so that it can run in worker processes;
each malformed line gets a reason that a user can act on, with its file and line number.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
from dataclasses import dataclass
from typing import Iterator, List, Sequence, Tuple, Union

JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")


def expand_inputs(patterns: Sequence[str]) -> List[str]:
    """Files named by `patterns` (paths or globs), in the order given, globs sorted.

    Raises:
        FileNotFoundError: a pattern matches nothing; the message names it.
    """
    files: List[str] = []
    for pattern in patterns:
        if glob.has_magic(pattern):
            matched = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
            if not matched:
                raise FileNotFoundError(f"--input {pattern!r} matches no file")
            files.extend(matched)
        elif os.path.isfile(pattern):
            files.append(pattern)
        else:
            raise FileNotFoundError(f"--input {pattern!r}: no such file")
    return files


def open_binary(path: str):
    """Open a plain or gzip file for reading bytes."""
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    return open(path, "rb")


@dataclass
class Chunk:
    """Consecutive lines of one file. `first_line` is 1-based; `end_offset` is how far into the
    file (on disk, so compressed bytes for .gz) reading has got, for progress bars."""

    file_index: int
    first_line: int
    lines: List[bytes]
    nbytes: int
    end_offset: int


def read_chunks(paths: Sequence[str], chunk_bytes: int = 1 << 20) -> Iterator[Chunk]:
    """Yield the lines of `paths` in chunks of about `chunk_bytes` (whole lines only)."""
    for file_index, path in enumerate(paths):
        line_no = 1
        with open(path, "rb") as raw:
            f = gzip.GzipFile(fileobj=raw, mode="rb") if path.endswith(".gz") else raw
            while True:
                try:
                    lines = f.readlines(chunk_bytes)
                except (OSError, EOFError) as e:  # gzip: corrupt or truncated stream
                    raise OSError(f"{path}: cannot read past line {line_no}: {e}") from e
                if not lines:
                    break
                yield Chunk(file_index, line_no, lines, sum(map(len, lines)), raw.tell())
                line_no += len(lines)


class BadLine(Exception):
    """A line that cannot be used; str() is the reason."""


def parse_line(line: bytes, keys: Sequence[str], allow_empty: bool = False) -> List[str]:
    """The text under each of `keys` in one JSONL line.

    With `allow_empty`, a blank line gives [] and whitespace-only documents are returned as they
    are (a tokenizer trainer just has nothing to learn from them).

    Raises:
        BadLine: invalid UTF-8, invalid JSON, not an object, a missing key, a non-string value or
            (unless `allow_empty`) a blank line or an empty (whitespace-only) document.
    """
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadLine(f"invalid UTF-8 at byte {e.start}") from None
    if not text.strip():
        if allow_empty:
            return []
        raise BadLine("empty line")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadLine(f"invalid JSON: {e.msg} at column {e.colno}") from None
    if not isinstance(obj, dict):
        raise BadLine(f"not a JSON object but {type(obj).__name__}")
    out = []
    for key in keys:
        if key not in obj:
            raise BadLine(f"missing key {key!r} (see --json-keys)")
        value = obj[key]
        if not isinstance(value, str):
            raise BadLine(f"value of {key!r} is {type(value).__name__}, not a string")
        if not value.strip() and not allow_empty:
            raise BadLine(f"empty document under {key!r}")
        out.append(value)
    return out


def iter_texts(
    paths: Sequence[str], keys: Sequence[str] = ("text",)
) -> Iterator[Union[Tuple[str, int, List[str]], Tuple[str, int, BadLine]]]:
    """(path, line number, texts or BadLine) for every line of `paths`, in order."""
    for chunk in read_chunks(paths):
        path = paths[chunk.file_index]
        for k, line in enumerate(chunk.lines):
            try:
                yield path, chunk.first_line + k, parse_line(line, keys)
            except BadLine as e:
                yield path, chunk.first_line + k, e
