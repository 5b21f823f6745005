"""Streaming JSONL input for the offline tools: files, globs, gzip, chunks of lines, bad lines.

Input is read as bytes in chunks of whole lines, never a whole file at once, so memory stays bounded
whatever the corpus size. Parsing is separate (`parse_line`) so that it can run in worker processes;
each malformed line gets a reason that a user can act on, with its file and line number.

A UTF-8 byte order mark (BOM) at the very start of a file, as Windows tools write it, is removed
(RFC 8259 lets a parser ignore it) and the chunk says so (`Chunk.bom`); a BOM anywhere else is
part of its line, which is then bad.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
from dataclasses import dataclass
from typing import Iterable, Iterator, List, Optional, Sequence, Tuple, Union

JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
UTF8_BOM = b"\xef\xbb\xbf"


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
    """Consecutive lines of one file. `first_line` is 1-based; `nbytes` counts the lines as read
    (a removed BOM included); `end_offset` is how far into the file (on disk, so compressed bytes
    for .gz) reading has got, for progress bars; `bom` is True for the first chunk of a file that
    began with a UTF-8 BOM, removed from its first line."""

    file_index: int
    first_line: int
    lines: List[bytes]
    nbytes: int
    end_offset: int
    bom: bool = False


def read_chunks(paths: Sequence[str], chunk_bytes: int = 1 << 20) -> Iterator[Chunk]:
    """Yield the lines of `paths` in chunks of about `chunk_bytes` (whole lines only), a UTF-8
    BOM at the start of each file removed (see `Chunk.bom`)."""
    return read_ranges(((i, path, 0, None, 1) for i, path in enumerate(paths)), chunk_bytes)


def read_ranges(ranges: Iterable[Tuple[int, str, int, Optional[int], int]],
                chunk_bytes: int = 1 << 20) -> Iterator[Chunk]:
    """The lines of byte ranges of files, as read_chunks yields whole files': each range is
    (file_index, path, start, end (None: the file's end), the number of its first line); start
    and end are line starts; a compressed file is read whole. A BOM is removed only at line 1."""
    for file_index, path, start, end, line_no in ranges:
        with open(path, "rb") as raw:
            if path.endswith(".gz"):
                f = gzip.GzipFile(fileobj=raw, mode="rb")
            else:
                f = raw
                raw.seek(start)
            pos = start
            while end is None or f is not raw or pos < end:
                try:
                    lines = f.readlines(chunk_bytes)
                except (OSError, EOFError) as e:  # gzip: corrupt or truncated stream
                    raise OSError(f"{path}: cannot read past line {line_no}: {e}") from e
                if f is raw and end is not None:  # stop at the range's end, a line start
                    lines = _until(lines, pos, end)
                if not lines:
                    break
                nbytes = sum(map(len, lines))
                if f is raw:
                    pos += nbytes
                bom = line_no == 1 and lines[0].startswith(UTF8_BOM)
                if bom:
                    lines[0] = lines[0][len(UTF8_BOM):]
                yield Chunk(file_index, line_no, lines, nbytes, pos if f is raw else raw.tell(),
                            bom)
                line_no += len(lines)


def _until(lines: List[bytes], pos: int, end: int) -> List[bytes]:
    """The leading `lines` (which start at byte `pos`) that end at or before `end`."""
    kept = 0
    for line in lines:
        if pos + len(line) > end:
            break
        pos += len(line)
        kept += 1
    return lines[:kept]


class BadLine(Exception):
    """A line that cannot be used; str() is the reason."""


def parse_line(line: bytes, keys: Sequence[str], allow_empty: bool = False,
               key_flags: Optional[Sequence[str]] = None) -> List[str]:
    """The text under each of `keys` in one JSONL line.

    With `allow_empty`, a blank line gives [] and whitespace-only documents are returned as they
    are (a tokenizer trainer just has nothing to learn from them).

    Raises:
        BadLine: invalid UTF-8, invalid JSON (nested too deeply and numbers too long included),
            not an object, a missing key, a non-string value, a string with a lone surrogate
            escape (`"\\ud800"`: JSON allows it, but no UTF-8 consumer such as SentencePiece
            can take it), a leading BOM (read_chunks removes a file's first) or (unless
            `allow_empty`) a blank line or an empty (whitespace-only) document. A key is named
            with its flag (`key_flags`, one per key, '' for none; default: --json-keys for a
            missing key).
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
        # Without its line break, a line cut short inside a string reads "Unterminated string",
        # not "Invalid control character".
        obj = json.loads(text.rstrip("\r\n"))
    except json.JSONDecodeError as e:
        if text.startswith("\ufeff"):  # read_chunks removed the one a file may begin with
            raise BadLine("invalid JSON: the line starts with a UTF-8 byte order mark (BOM); "
                          "only a file's first line may") from None
        msg = e.msg[:-3] if e.msg.endswith(" at") else e.msg  # "Invalid control character at"
        raise BadLine(f"invalid JSON: {msg} at column {e.colno}") from None
    except RecursionError:
        raise BadLine("invalid JSON: nested too deeply") from None
    except ValueError as e:  # an integer longer than Python converts; the advice after ';' is
        # for programmers, not for the user of a tool
        raise BadLine(f"invalid JSON: {str(e).split(';')[0]}") from None
    if not isinstance(obj, dict):
        raise BadLine(f"not a JSON object but {type(obj).__name__}")
    out = []
    for i, key in enumerate(keys):
        flag = "see --json-keys" if key_flags is None else key_flags[i]
        if key not in obj:
            raise BadLine(f"missing key {key!r}" + (f" ({flag})" if flag else ""))
        value = obj[key]
        if not isinstance(value, str):
            named = repr(key) if key_flags is None or not flag else f"{key!r} ({flag})"
            raise BadLine(f"value of {named} is {type(value).__name__}, not a string")
        if "\\u" in text:  # a lone surrogate can only come from an escape: UTF-8 cannot carry one
            _check_encodable(key, value)
        if not value.strip() and not allow_empty:
            raise BadLine(f"empty document under {key!r}")
        out.append(value)
    return out


def _check_encodable(key: str, value: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:  # strict UTF-8 refuses only surrogates
        raise BadLine(f"value of {key!r} has a lone surrogate \\u{ord(value[e.start]):04x} at "
                      f"character {e.start} (not encodable as UTF-8)") from None


def read_fields(path: str, keys: Sequence[str],
                key_flags: Optional[Sequence[str]] = None) -> List[List[str]]:
    """The strings under `keys` of each line of the small JSONL file `path` (read whole; blank
    lines skipped, empty strings kept), each line checked by `parse_line`.

    Raises:
        BadLine: "PATH line N: reason" for the first bad line.
        OSError: the file cannot be read.
    """
    out = []
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            if number == 1 and line.startswith(UTF8_BOM):
                line = line[len(UTF8_BOM):]
            if not line.strip():
                continue
            try:
                out.append(parse_line(line, keys, allow_empty=True, key_flags=key_flags))
            except BadLine as e:
                raise BadLine(f"{path} line {number}: {e}") from None
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
