"""megatron/data/preprocess/jsonl.py: every bad kind of line gets a reason; good lines give their texts; a
file's leading UTF-8 BOM is removed, and only that one."""

import gzip

import pytest

from megatron.data.preprocess.jsonl import UTF8_BOM, BadLine, parse_line, read_chunks


@pytest.mark.parametrize("line, texts", [
    (b'{"text": "Speak, speak."}', ["Speak, speak."]),
    (b'{"text": "masks \\ud83c\\udfad"}', ["masks \U0001f3ad"]),  # an escaped surrogate pair
    (b'{"text": "a \\\\ud800 b"}', ["a \\ud800 b"]),  # an escaped backslash, not an escape
    (b'{"text": "caf\xc3\xa9", "n": 1}', ["caf\u00e9"]),
])
def test_good_lines(line, texts):
    assert parse_line(line, ["text"]) == texts


@pytest.mark.parametrize("line, reason", [
    (b'{"text": "broken', "invalid JSON: Unterminated string starting at column 10"),
    (b'{"text": "broken\r\n', "invalid JSON: Unterminated string starting at column 10"),
    (b'{"text": "a\tb"}', "invalid JSON: Invalid control character at column 12"),
    (b'{"text": "caf\xe9"}', "invalid UTF-8 at byte 13"),
    (b'{"text": "\xed\xa0\x80"}', "invalid UTF-8 at byte 10"),  # a surrogate encoded as UTF-8
    (b'["an", "array"]', "not a JSON object but list"),
    (b'"a string"', "not a JSON object but str"),
    (b'{"body": "x"}', "missing key 'text'"),
    (b'{"text": 42}', "value of 'text' is int, not a string"),
    (b'{"text": null}', "value of 'text' is NoneType, not a string"),
    (b'{"text": NaN}', "value of 'text' is float, not a string"),
    (b'{"text": "  "}', "empty document under 'text'"),
    (b"", "empty line"),
    (b'{"text": "lone \\ud800 high"}',
     "value of 'text' has a lone surrogate \\ud800 at character 5 (not encodable as UTF-8)"),
    (b'{"text": "\\udfff"}',
     "value of 'text' has a lone surrogate \\udfff at character 0 (not encodable as UTF-8)"),
    (b'{"text": "x\\udc00\\ud800"}', "value of 'text' has a lone surrogate \\udc00 at character 1"),
    (b"[" * 100_000 + b"]" * 100_000, "invalid JSON: nested too deeply"),
    (b'{"text": ' + b"7" * 5000 + b"}", "invalid JSON: "),
])
def test_bad_lines(line, reason):
    with pytest.raises(BadLine) as info:
        parse_line(line, ["text"])
    assert str(info.value).startswith(reason), str(info.value)


def test_the_second_key_is_checked_too():
    with pytest.raises(BadLine, match="lone surrogate"):
        parse_line(b'{"text": "ok", "title": "\\ud800"}', ["text", "title"])
    assert parse_line(b'{"text": "ok", "title": "\\ud800"}', ["text"]) == ["ok"]


def test_allow_empty_keeps_blank_documents_but_not_surrogates():
    assert parse_line(b"  ", ["text"], allow_empty=True) == []
    assert parse_line(b'{"text": " "}', ["text"], allow_empty=True) == [" "]
    with pytest.raises(BadLine, match="lone surrogate"):
        parse_line(b'{"text": "\\ud800"}', ["text"], allow_empty=True)


def test_a_line_starting_with_a_bom_is_bad():
    with pytest.raises(BadLine, match="starts with a UTF-8 byte order mark"):
        parse_line(UTF8_BOM + b'{"text": "x"}', ["text"])
    assert UTF8_BOM == "\ufeff".encode("utf-8")


@pytest.mark.parametrize("chunk_bytes", [1, 1 << 20])  # a line per chunk; one chunk per file
def test_read_chunks_removes_the_bom_that_starts_each_file_and_no_other(tmp_path, chunk_bytes):
    lines = [b'{"text": "one"}\n', UTF8_BOM + b'{"text": "two"}\n', b'{"text": "\xef\xbb\xbf"}\n']
    plain, gz, none = tmp_path / "a.jsonl", tmp_path / "b.jsonl.gz", tmp_path / "c.jsonl"
    plain.write_bytes(UTF8_BOM + b"".join(lines))
    with gzip.open(gz, "wb") as f:
        f.write(UTF8_BOM + b"".join(lines))
    none.write_bytes(b"".join(lines))
    chunks = list(read_chunks([str(plain), str(gz), str(none)], chunk_bytes=chunk_bytes))
    for index in range(3):
        mine = [c for c in chunks if c.file_index == index]
        assert [line for c in mine for line in c.lines] == lines  # only the first BOM is gone
        assert [c.bom for c in mine] == [index < 2] + [False] * (len(mine) - 1)
        # the BOM's bytes were read: progress and MB/s count them
        assert sum(c.nbytes for c in mine) == len(b"".join(lines)) + 3 * (index < 2)
    assert [parse_line(line, ["text"]) for line in lines[::2]] == [["one"], ["\ufeff"]]
