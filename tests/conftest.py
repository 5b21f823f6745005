"""Session fixtures shared by the test suite: the real-text corpora, a small SentencePiece model,
and a small preprocessed dataset with tiny model configs for the training and launch tests; a
one-process gloo group."""

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]
CORPORA = ("en_wikitext2.jsonl", "en_shakespeare.jsonl", "zh_cmrc2018_wiki.jsonl",
           "zh_cmrc2019_stories.jsonl")


@pytest.fixture(scope="session")
def corpora_dir() -> Path:
    """The real-text corpora: $T5_CORPORA_DIR, else the repository's tests/data/corpora.

    Missing corpora fail the tests that need them rather than skipping them, so that a broken
    setup cannot pass as green.
    """
    path = Path(os.environ.get("T5_CORPORA_DIR") or REPO / "tests" / "data" / "corpora")
    missing = [name for name in CORPORA if not (path / name).is_file()]
    if missing:
        pytest.fail(f"corpora not found: {path} lacks {', '.join(missing)} (tests/data/corpora "
                    "has them; T5_CORPORA_DIR overrides it)", pytrace=False)
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


TINY_MODEL = dict(vocab_size=4100, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                  num_decoder_layers=2, num_heads=4, feed_forward_proj="gated-gelu",
                  tie_word_embeddings=False, dropout_rate=0.0)


@pytest.fixture(scope="session")
def train_data(spm_model, corpora_dir, tmp_path_factory):
    """Shakespeare and Chinese stories as one .bin/.idx (about 0.6 MB of text), the session's
    tokenizer, and tiny model configs (dropout 0 and 0.1)."""
    from data_tools import preprocess_data

    out = tmp_path_factory.mktemp("train_data")
    sample = out / "corpus.jsonl"
    with open(sample, "w", encoding="utf-8") as f:
        for name in ("en_shakespeare.jsonl", "zh_cmrc2019_stories.jsonl"):
            with open(corpora_dir / name, encoding="utf-8") as src:
                for i, line in enumerate(src):
                    if i == 150:
                        break
                    f.write(line)
    prefix = out / "mix"
    rc = preprocess_data.main(["--input", str(sample), "--output-prefix", str(prefix),
                               "--tokenizer-model", str(spm_model), "--append-eod",
                               "--workers", "1", "--no-progress"])
    assert rc == 0
    configs = {}
    for name, dropout in (("tiny", 0.0), ("tiny_dropout", 0.1)):
        path = out / f"{name}.json"
        path.write_text(json.dumps({**TINY_MODEL, "dropout_rate": dropout}))
        configs[name] = str(path)
    return SimpleNamespace(prefix=str(out / "mix_text_document"), spm=str(spm_model),
                           cache=str(out / "cache"), root=out, **configs)


@pytest.fixture
def one_process_group(tmp_path):
    """torch.distributed joined as the only rank of a gloo group, left at the end."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
