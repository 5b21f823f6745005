"""docs/flags.md is what data_tools/make_flags_doc.py generates from the training parser."""

import re

from data_tools import make_flags_doc
from megatron.arguments import build_parser


def test_flags_doc_is_up_to_date():
    assert make_flags_doc.check() == []
    assert make_flags_doc.main(["--check"]) == 0


def test_every_option_string_is_documented():
    text = make_flags_doc.DEFAULT_OUTPUT.read_text(encoding="utf-8")
    documented = set(re.findall(r"`(-{1,2}[A-Za-z0-9_-]+)`", text))
    options = {s for a in build_parser()._actions for s in a.option_strings}
    assert options - documented == set()


def test_check_fails_on_a_stale_file(tmp_path, capsys):
    stale = tmp_path / "flags.md"
    stale.write_text(make_flags_doc.render().replace("--lr-decay-style", "--lr-decay"),
                     encoding="utf-8")
    assert make_flags_doc.main(["--check", "--output", str(stale)]) == 1
    assert "python data_tools/make_flags_doc.py" in capsys.readouterr().err
    assert make_flags_doc.main(["--check", "--output", str(tmp_path / "missing.md")]) == 1


def test_aliases_share_a_row():
    rows = [line for line in make_flags_doc.render().splitlines() if "`--batch-size`" in line]
    assert len(rows) == 1 and "`--micro-batch-size`" in rows[0]
