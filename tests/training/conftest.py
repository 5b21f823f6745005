"""Fixtures for the training tests: a small preprocessed corpus and tiny model configs."""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "distributed"))  # the process harness

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
