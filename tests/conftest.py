"""Session fixtures shared by the test suite: the shared corpora and a small SentencePiece model."""

import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CORPORA = ("en_wikitext2.jsonl", "en_shakespeare.jsonl", "zh_cmrc2018_wiki.jsonl",
           "zh_cmrc2019_stories.jsonl")


@pytest.fixture(scope="session")
def corpora_dir() -> Path:
    """The shared real-text corpora: $T5_CORPORA_DIR, else <repo>/../shared/corpora.

    Missing corpora fail the tests that need them (with where to put them) rather than skipping
    them, so that a broken setup cannot pass as green.
    """
    path = Path(os.environ.get("T5_CORPORA_DIR") or REPO.parent / "shared" / "corpora")
    missing = [name for name in CORPORA if not (path / name).is_file()]
    if missing:
        pytest.fail(f"shared corpora not found: {path} lacks {', '.join(missing)}; set "
                    "T5_CORPORA_DIR to the folder holding them", pytrace=False)
    return path


@pytest.fixture(scope="session")
def spm_model(corpora_dir, tmp_path_factory) -> Path:
    """A small T5-layout SentencePiece model (unigram, 4000 pieces, byte fallback), trained once
    per session by our own data_tools/train_tokenizer.py on ~100 KB of each corpus (~400 KB of
    English and Chinese; about 2 s)."""
    from data_tools import train_tokenizer

    out = tmp_path_factory.mktemp("spm")
    sample = out / "sample.jsonl"
    with open(sample, "w", encoding="utf-8") as f:
        for name in CORPORA:
            taken = 0
            with open(corpora_dir / name, encoding="utf-8") as src:
                for line in src:
                    text = json.loads(line)["text"]
                    # WikiText documents are long: take a slice of each of several, not one whole.
                    text = text[:20_000]
                    f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
                    taken += len(text.encode("utf-8"))
                    if taken >= 100_000:
                        break
    prefix = out / "t5_small"
    rc = train_tokenizer.main(["--input", str(sample), "--output-prefix", str(prefix),
                               "--vocab-size", "4000", "--model-type", "unigram",
                               "--character-coverage", "0.9995", "--byte-fallback",
                               "--num-threads", "2", "--seed", "1"])
    if rc != 0:
        pytest.fail(f"training the session's SentencePiece model failed (exit {rc})")
    return prefix.with_suffix(".model")
