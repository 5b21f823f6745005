"""megatron/data/jsonl.py: every bad kind of line gets a reason; good lines give their texts."""

import pytest

from megatron.data.jsonl import BadLine, parse_line


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
