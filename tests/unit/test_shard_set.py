"""A shard set (preprocess_data.py --num-shards) read as one --data-path
(megatron/data/storage/shard_set.py): the merged file's documents and training run, in a blend,
a missing shard named, inspect_dataset.py on a set."""

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "distributed"))  # the process harness
sys.path.insert(0, str(HERE.parent / "training"))  # its training workers

from harness import run_workers  # noqa: E402
from train_workers import base_argv, run_pretrain  # noqa: E402

from data_tools import inspect_dataset, preprocess_data  # noqa: E402
from megatron.data.datasets.builder import data_file_problems, parse_data_path  # noqa: E402
from megatron.data.storage.indexed_dataset import IndexedDataset  # noqa: E402
from megatron.data.storage.shard_set import ShardSet, ShardSetError, open_dataset  # noqa: E402


def write_set(corpus, spm, out, n=3):
    """The corpus preprocessed as n shards (each as its own task would), as train_data's file is
    (--append-eod, one worker); returns the set's --data-path."""
    for i in range(n):
        assert preprocess_data.main([
            "--input", str(corpus), "--output-prefix", str(out), "--tokenizer-model", str(spm),
            "--append-eod", "--workers", "1", "--no-progress", "--num-shards", str(n),
            "--shard-index", str(i)]) == 0
    return f"{out}_text_document"


@pytest.fixture(scope="module")
def shard_set(train_data, tmp_path_factory):
    folder = tmp_path_factory.mktemp("set")
    return write_set(train_data.root / "corpus.jsonl", train_data.spm, folder / "mix")


def test_the_set_holds_the_merged_files_documents_in_order(train_data, shard_set):
    merged, got = IndexedDataset(train_data.prefix), open_dataset(shard_set)
    assert isinstance(got, ShardSet) and len(got.shards) == 3
    assert all(len(s) for s in got.shards)  # each shard holds documents: the seams are crossed
    assert (got.num_documents, len(got), got.num_tokens, got.dtype) == \
        (merged.num_documents, len(merged), merged.num_tokens, merged.dtype)
    assert np.array_equal(got.sequence_lengths, merged.sequence_lengths)
    assert np.array_equal(got.document_indices, merged.document_indices)
    for i in range(len(merged)):
        assert np.array_equal(got[i], merged[i])
    seam = len(got.shards[0])
    assert [a.tolist() for a in got[seam - 2:seam + 2]] == \
        [a.tolist() for a in merged[seam - 2:seam + 2]]
    assert np.array_equal(got.get(seam, 1, 3), merged.get(seam, 1, 3))
    assert got.eod_decision(1).appended == merged.eod_decision(1).appended is True
    import pickle  # loader workers receive the set pickled: they reopen it

    again = pickle.loads(pickle.dumps(got))
    assert np.array_equal(again.document_indices, merged.document_indices)
    assert np.array_equal(again[seam], merged[seam])


def test_a_run_on_the_set_has_the_losses_of_the_run_on_the_merged_file(train_data, shard_set,
                                                                       tmp_path):
    """The set is the merged file's documents in its order (above), so the split, the sample
    index caches and so the samples are the same: the losses are compared bit for bit (one
    process each). The set's caches are its own (named by its shards), built once."""
    set_data = type(train_data)(**{**vars(train_data), "prefix": shard_set,
                                   "cache": str(tmp_path / "set-cache")})
    merged, on_set = run_workers(1, run_pretrain, [
        base_argv(train_data, "--data-cache-path", str(tmp_path / "merged-cache")),
        base_argv(set_data)], timeout=600)[0]
    assert sorted(on_set["losses"]) == [1, 2, 3, 4]
    assert on_set["losses"] == merged["losses"]
    assert on_set["evals"] == merged["evals"]
    built = sorted(p.name.split("-")[0] for p in (tmp_path / "set-cache").iterdir()
                   if p.is_dir())
    assert built == ["mix_text_document_test", "mix_text_document_train",
                     "mix_text_document_valid"]  # one entry per split for the whole set


def test_a_set_in_a_weighted_blend(train_data, shard_set):
    from megatron.data.datasets.builder import DataConfig, build_datasets
    from megatron.data.datasets.t5_dataset import T5DatasetConfig, T5SpecialTokens

    prefixes, weights = parse_data_path(["0.3", train_data.prefix, "0.7", shard_set])
    assert prefixes == [train_data.prefix, shard_set] and weights == [0.3, 0.7]
    assert data_file_problems(["0.3", train_data.prefix, "0.7", shard_set]) == []
    tokens = T5SpecialTokens(0, 1, 0, tuple(range(4100, 4000, -1)))
    config = DataConfig(["0.3", train_data.prefix, "0.7", shard_set], split="1,0,0",
                        data_cache_path=str(Path(shard_set).parent / "blend-cache"),
                        t5=T5DatasetConfig(encoder_seq_length=64, seed=3))
    train = build_datasets(config, tokens, (200, 0, 0))["train"]
    chosen = np.bincount(train.dataset_index, minlength=2)
    assert chosen.tolist() == [60, 140]  # exact proportion
    # the set's part serves the samples the merged file's part would: the same documents
    alone = DataConfig([train_data.prefix], split="1,0,0", data_cache_path=config.data_cache_path,
                       t5=config.t5)
    same = build_datasets(alone, tokens, (141, 0, 0))["train"]
    for i in range(10):
        assert np.array_equal(train.datasets[1].raw_tokens(i), same.raw_tokens(i))


def test_a_missing_shard_is_named_and_refused_before_start(train_data, shard_set, tmp_path,
                                                           capsys):
    folder = tmp_path / "broken"
    shutil.copytree(Path(shard_set).parent, folder, ignore=shutil.ignore_patterns("*cache*"))
    prefix = str(folder / Path(shard_set).name)
    gone = str(folder / "mix-00001-of-00003_text_document")
    for suffix in (".bin", ".idx"):
        (Path(gone + suffix)).unlink()
    with pytest.raises(ShardSetError, match=f"shard {gone} of the set {prefix} is missing"):
        ShardSet(prefix)
    problems = data_file_problems([prefix])
    assert len(problems) == 1 and gone in problems[0]
    from megatron.pretrain_t5 import main

    set_data = type(train_data)(**{**vars(train_data), "prefix": prefix,
                                   "cache": str(tmp_path / "cache")})
    assert main(base_argv(set_data)) == 2
    err = capsys.readouterr().err
    assert err.count(gone) == 1, err
    assert not (tmp_path / "cache").exists()  # refused before anything was built


def test_inspect_dataset_reads_a_set(train_data, shard_set, capsys):
    assert inspect_dataset.main([train_data.prefix]) == 0
    merged = capsys.readouterr().out.splitlines()
    assert inspect_dataset.main([shard_set]) == 0
    on_set = capsys.readouterr().out.splitlines()
    assert on_set[0] == merged[0].replace(train_data.prefix, shard_set)
    assert on_set[1:] == merged[1:]


def test_build_indices_builds_the_sets_caches_once(train_data, shard_set, tmp_path, capsys):
    from data_tools import build_indices

    argv = ["--data-path", shard_set, "--tokenizer-model", train_data.spm, "--train-iters", "10",
            "--global-batch-size", "4", "--encoder-seq-length", "64", "--split", "90,10,0",
            "--data-cache-path", str(tmp_path)]
    assert build_indices.main(argv) == 0
    assert capsys.readouterr().err.count("built index cache") == 2  # train, valid: the set's
    assert build_indices.main(argv) == 0
    assert "built index cache" not in capsys.readouterr().err  # found, not rebuilt


def test_a_shard_rewritten_after_the_manifest_is_named(shard_set, tmp_path):
    import json

    folder = tmp_path / "stale"
    shutil.copytree(Path(shard_set).parent, folder, ignore=shutil.ignore_patterns("*cache*"))
    manifest = folder / (Path(shard_set).name + ".shards.json")
    body = json.loads(manifest.read_text())
    body["shards"][2]["tokens"] += 1
    manifest.write_text(json.dumps(body))
    with pytest.raises(ShardSetError, match="mix-00002-of-00003_text_document has .* but .* lists"):
        ShardSet(str(folder / Path(shard_set).name))


def test_shards_that_disagree_on_eod_are_refused_naming_them(train_data, shard_set, tmp_path):
    from megatron.data.preprocess.manifest import write_manifest

    folder = tmp_path / "mixed"
    shutil.copytree(Path(shard_set).parent, folder, ignore=shutil.ignore_patterns("*cache*"))
    odd = folder / "mix-00001-of-00003_text_document"
    assert preprocess_data.main([  # shard 1 again, without --append-eod
        "--input", str(train_data.root / "corpus.jsonl"), "--output-prefix", str(folder / "mix"),
        "--tokenizer-model", train_data.spm, "--workers", "1", "--no-progress",
        "--num-shards", "3", "--shard-index", "1"]) == 0
    write_manifest(str(folder / "mix"), "_text_document", 3)  # counts of the new shard 1
    prefix = str(folder / Path(shard_set).name)
    with pytest.raises(ShardSetError, match=f"mixes shards with and without EOD: .* and {odd} "):
        ShardSet(prefix).eod_decision(1)
    assert ShardSet(prefix).eod_decision(1, "yes").appended  # the flag settles it
