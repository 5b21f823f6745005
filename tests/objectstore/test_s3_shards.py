"""preprocess_data.py --num-shards to s3://: each shard uploads its own files, the last one the
set's manifest; the same bytes as the shards written locally."""

from pathlib import Path

from data_tools import preprocess_data


def test_shards_written_to_s3_and_the_manifest_by_the_last(s3_server, s3_env, train_data,
                                                          tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    s3_server.client().create_bucket(Bucket="shards")

    def preprocess(prefix, index):
        return preprocess_data.main(["--input", str(train_data.root / "corpus.jsonl"),
                                     "--output-prefix", prefix, "--tokenizer-model",
                                     train_data.spm, "--append-eod", "--workers", "1",
                                     "--no-progress", "--num-shards", "2", "--shard-index",
                                     str(index)])

    root = Path(s3_server.root) / "shards" / "out"
    for index in (1, 0):
        assert preprocess("s3://shards/out/mix", index) == 0
        assert (root / "mix_text_document.shards.json").exists() == (index == 0)
        assert preprocess(str(tmp_path / "local" / "mix"), index) == 0
    local = tmp_path / "local"
    assert sorted(p.name for p in root.iterdir()) == sorted(p.name for p in local.iterdir())
    for path in local.iterdir():  # the same bytes as the shards and manifest written locally
        assert (root / path.name).read_bytes() == path.read_bytes(), path.name
