"""The tests need nothing outside the repository: no test names a path beside the checkout (the
../shared/corpora of a development machine), and the shipped corpora are those tests/data/README.md
describes. .ci/run proves the same by running the suite from a copy alone in a fresh folder."""

import hashlib
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
# `../shared`, `shared/corpora`, or a path part "shared" joined in Python (`parent / "shared"`).
OUTSIDE = re.compile(r"\.\./shared|shared/corpora|/\s*[\"']shared[\"']")
SOURCE_SUFFIXES = {".py", ".sh", ".json", ".toml", ".cfg", ".ini", ".yaml", ".txt", ".md"}


def test_no_test_file_refers_to_a_folder_beside_the_repository():
    hits = []
    for path in sorted(TESTS.rglob("*")):
        inside = path.relative_to(TESTS).parts
        if (path.suffix not in SOURCE_SUFFIXES or inside[0] == "data"
                or path == Path(__file__).resolve()):
            continue
        text = path.read_text(encoding="utf-8")
        hits += [f"{path.relative_to(REPO)}:{n}: {line.strip()}"
                 for n, line in enumerate(text.splitlines(), 1) if OUTSIDE.search(line)]
    assert not hits, ("tests must read their data from the repository (tests/data), not from "
                      "beside it:\n" + "\n".join(hits))


def test_shipped_corpora_match_their_readme():
    readme = (TESTS / "data" / "README.md").read_text(encoding="utf-8")
    listed = dict((name, digest) for digest, name in
                  re.findall(r"^([0-9a-f]{64})  (\S+\.jsonl)$", readme, re.MULTILINE))
    shipped = {p.name for p in (TESTS / "data" / "corpora").glob("*.jsonl")}
    assert set(listed) == shipped
    for name, digest in listed.items():
        data = (TESTS / "data" / "corpora" / name).read_bytes()
        assert hashlib.sha256(data).hexdigest() == digest, name
