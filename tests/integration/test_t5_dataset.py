"""The T5 dataset on real corpora: span statistics, packing, shapes, determinism, resume, blends."""

import argparse
import json
import multiprocessing

import numpy as np
import pytest

from data_tools import build_indices, preprocess_data
from megatron.data.datasets.builder import BlendedDataset, DataConfig, build_datasets
from megatron.data.data_args import add_data_args, data_config_from_args, sample_counts_from_args
from megatron.data.storage.indexed_dataset import IndexedDataset
from megatron.data.datasets.samplers import PretrainingSampler
from megatron.data.datasets.span_corruption import uncorrupt
from megatron.data.datasets.t5_dataset import (
    IGNORE_INDEX,
    T5DatasetConfig,
    T5SpanCorruptionDataset,
    T5SpecialTokens,
    collate,
)
from megatron.data.tokenizers.tokenizer import T5Tokenizer


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, spm_model, corpora_dir):
    """English and Chinese corpora preprocessed into two document datasets (with EOD)."""
    out = tmp_path_factory.mktemp("t5data")
    prefixes = {}
    for lang, names in {"en": ["en_shakespeare.jsonl", "en_wikitext2.jsonl"],
                        "zh": ["zh_cmrc2018_wiki.jsonl", "zh_cmrc2019_stories.jsonl"]}.items():
        args = ["--input", *[str(corpora_dir / n) for n in names], "--output-prefix",
                str(out / lang), "--tokenizer-model", str(spm_model), "--append-eod",
                "--workers", "2", "--no-progress"]
        assert preprocess_data.main(args) == 0
        prefixes[lang] = str(out / f"{lang}_text_document")
    tok = T5Tokenizer(str(spm_model))
    return prefixes, tok, T5SpecialTokens.from_tokenizer(tok)


def dataset(corpus, lang="en", n=2000, enc=128, seed=7, docs=None, **kw):
    prefixes, _, special = corpus
    ds = IndexedDataset(prefixes[lang])
    cfg = T5DatasetConfig(encoder_seq_length=enc, seed=seed, **kw)
    return T5SpanCorruptionDataset("train", ds, docs or (0, ds.num_documents), n, cfg, special)


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_span_statistics_and_exact_inverse(corpus, lang):
    _, tok, special = corpus
    ds = dataset(corpus, lang, n=10000)
    sentinels = set(special.sentinel_ids)
    noise, spans = 0, 0
    for i in range(len(ds)):
        s = ds[i]
        inputs = s["encoder_input_ids"][s["encoder_attention_mask"] == 1]
        labels = s["labels"][s["labels"] != IGNORE_INDEX]
        used_in = [t for t in inputs.tolist() if t in sentinels]
        used_out = [t for t in labels.tolist() if t in sentinels]
        assert used_in == used_out == sorted(used_in, reverse=True)  # each once, <extra_id_0> first
        assert len(set(used_in)) == len(used_in)
        np.testing.assert_array_equal(
            uncorrupt(inputs, labels, np.asarray(special.sentinel_ids), tok.eos_id),
            ds.raw_tokens(i))
        spans += len(used_in)
        noise += len(labels) - len(used_in) - 1
    raw = ds.raw_length * len(ds)
    assert abs(noise / raw - 0.15) < 0.01
    assert abs(noise / spans - 3.0) < 0.3


def test_packing_reproduces_the_document_stream(corpus):
    ds = dataset(corpus, n=300)
    indexed = ds.indexed
    stream = np.concatenate([ds.packed_tokens(j) for j in range(300)])
    docs = [np.concatenate(indexed.document(int(d))) for d in ds.doc_idx[:400]]
    expected = np.concatenate(docs)[:len(stream)]
    np.testing.assert_array_equal(stream, expected)
    assert (expected == corpus[1].eos_id).sum() > 0  # documents end with EOS inside samples


def test_shapes_padding_and_shift(corpus):
    ds = dataset(corpus, n=64, enc=256)
    batch = collate([ds[i] for i in range(8)])
    raw, enc, dec = ds.raw_length, ds.encoder_length, ds.decoder_length
    assert (raw, enc, dec) == (284, 256, 58)  # noise round(42.6)=43 in round(43/3)=14 spans
    for key, length in [("encoder_input_ids", enc), ("encoder_attention_mask", enc),
                        ("decoder_input_ids", dec), ("labels", dec),
                        ("decoder_attention_mask", dec)]:
        assert batch[key].shape == (8, length) and batch[key].dtype == np.int64
    labels = batch["labels"]
    shifted = np.where(labels == IGNORE_INDEX, 0, labels)
    expected = np.concatenate([np.zeros((8, 1), np.int64), shifted[:, :-1]], axis=1)
    np.testing.assert_array_equal(batch["decoder_input_ids"], expected)
    np.testing.assert_array_equal(batch["decoder_attention_mask"], labels != IGNORE_INDEX)
    # A longer decoder pads labels with -100 and inputs with pad.
    padded = dataset(corpus, n=4, enc=256, decoder_seq_length=64)[0]
    assert (padded["labels"][58:] == IGNORE_INDEX).all() and (padded["decoder_input_ids"][59:] == 0).all()


def test_virtual_eos_between_documents_without_eod(tmp_path, corpus, spm_model):
    texts = ["alpha beta gamma delta " * 20, "one two three four " * 30, "red green blue " * 25]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    assert preprocess_data.main(["--input", str(tmp_path / "in.jsonl"), "--output-prefix",
                                 str(tmp_path / "noeod"), "--tokenizer-model", str(spm_model),
                                 "--workers", "1", "--no-progress"]) == 0
    tok = corpus[1]
    indexed = IndexedDataset(str(tmp_path / "noeod_text_document"))
    ds = T5SpanCorruptionDataset("train", indexed, (0, 3), 10, T5DatasetConfig(32, seed=1),
                                 corpus[2], str(tmp_path / "cache"))
    stream = np.concatenate([ds.packed_tokens(j) for j in range(len(ds.sample_idx) - 1)])
    expected = np.concatenate([np.concatenate([indexed[int(d)], [tok.eos_id]])
                               for d in ds.doc_idx])[:len(stream)]
    np.testing.assert_array_equal(stream, expected)


def _batches_in_child(args, queue):
    corpus, rank, dp = args
    queue.put(_batches(corpus, rank, dp, workers=0))


def _batches(corpus, rank, dp, workers, consumed=0, steps=6):
    import torch

    ds = dataset(corpus, n=200)
    sampler = PretrainingSampler(len(ds), consumed, 4, rank, dp)
    loader = torch.utils.data.DataLoader(ds, batch_sampler=sampler, num_workers=workers,
                                         collate_fn=collate)
    out = []
    for step, batch in enumerate(loader):
        if step == steps:
            break
        out.append({k: np.asarray(v) for k, v in batch.items()})
    return out


def test_determinism_workers_processes_and_dp(corpus):
    reference = _batches(corpus, 0, 1, workers=0)
    with_workers = _batches(corpus, 0, 1, workers=2)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_batches_in_child, args=((corpus, 0, 1), queue))
    child.start()
    from_child = queue.get(timeout=300)
    child.join(60)
    for a, b, c in zip(reference, with_workers, from_child):
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
            np.testing.assert_array_equal(a[key], c[key])
    # Two data-parallel ranks with micro batch 4 == one rank with micro batch 8.
    global_batches = [collate([dataset(corpus, n=200)[i] for i in range(s * 8, (s + 1) * 8)])
                      for s in range(3)]
    shards = [_batches(corpus, r, 2, workers=0, steps=3) for r in range(2)]
    for step in range(3):
        for key in global_batches[step]:
            joined = np.concatenate([shards[0][step][key], shards[1][step][key]])
            np.testing.assert_array_equal(joined, global_batches[step][key])


def test_resume_continues_the_stream(corpus):
    straight = _batches(corpus, 0, 1, workers=0, steps=6)
    resumed = _batches(corpus, 0, 1, workers=0, consumed=3 * 4, steps=3)
    for a, b in zip(straight[3:], resumed):
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])


def test_blend_proportions_and_cache_reuse(corpus, tmp_path):
    prefixes = corpus[0]
    config = DataConfig(data_path=["0.3", prefixes["en"], "0.7", prefixes["zh"]], split="98,2,0",
                        data_cache_path=str(tmp_path / "cache"),
                        t5=T5DatasetConfig(encoder_seq_length=128, seed=3))
    built = build_datasets(config, corpus[2], (1000, 50, 0))
    train = built["train"]
    assert isinstance(train, BlendedDataset) and len(train) == 1000 and built["test"] is None
    counts = np.cumsum(np.stack([train.dataset_index == k for k in (0, 1)], axis=1), axis=0)
    expected = np.outer(np.arange(1, 1001), [0.3, 0.7])
    assert np.abs(counts - expected).max() <= 1.0  # within one sample at every prefix
    first = train[17]
    entries = sorted(p.name for p in (tmp_path / "cache").iterdir())
    again = build_datasets(config, corpus[2], (1000, 50, 0))["train"]
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == entries  # reused
    for key in first:
        np.testing.assert_array_equal(first[key], again[17][key])


def test_build_indices_prebuilds_what_training_reads(corpus, tmp_path, spm_model, capsys):
    prefixes = corpus[0]
    argv = ["--data-path", "0.5", prefixes["en"], "0.5", prefixes["zh"], "--split", "90,10,0",
            "--tokenizer-model", str(spm_model), "--encoder-seq-length", "128",
            "--train-iters", "50", "--global-batch-size", "8", "--eval-interval", "25",
            "--eval-iters", "2", "--data-cache-path", str(tmp_path / "cache"), "--lr", "1e-4"]
    assert build_indices.main(argv) == 0
    err = capsys.readouterr().err
    assert "train: 400 samples" in err and "valid: 48 samples" in err and "--lr" in err
    entries = sorted(p.name for p in (tmp_path / "cache").iterdir())
    # Training with the same flags finds every cache: nothing new is built.
    args, _ = add_data_args(argparse.ArgumentParser()).parse_known_args(argv)
    build_datasets(data_config_from_args(args), corpus[2], sample_counts_from_args(args))
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == entries
    assert "built index cache" not in capsys.readouterr().err


def test_build_indices_reports_bad_flags(spm_model, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        build_indices.main(["--data-path", str(tmp_path / "x"), "--tokenizer-model",
                            str(spm_model), "--train-iters", "0", "--global-batch-size", "8",
                            "--noise-density", "2"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--train-iters must be positive" in err and "--noise-density 2.0" in err
    # a missing dataset is input refused before anything is built: 2, as training gives it
    with pytest.raises(SystemExit) as e:
        build_indices.main(["--data-path", str(tmp_path / "x"), "--tokenizer-model",
                            str(spm_model), "--train-iters", "5", "--global-batch-size", "8"])
    assert e.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "no .bin/.idx pair" in err[0] and str(tmp_path / "x") in err[0]
    # flags of the training command pass; flags the trainer would refuse are refused
    with pytest.raises(SystemExit) as e:
        build_indices.main(["--data-path", str(tmp_path / "x"), "--tokenizer-model",
                            str(spm_model), "--train-iters", "5", "--global-batch-size", "8",
                            "--lr", "1e-4", "--use-distributed-optimizer"])
    assert e.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "use --zero-stage 1 or higher" in err[0], err


def test_megatron_objective_on_sentence_data(tmp_path, spm_model, corpora_dir, corpus):
    from megatron.data.datasets.megatron_t5_dataset import MegatronT5Dataset

    assert preprocess_data.main(["--input", str(corpora_dir / "zh_cmrc2019_stories.jsonl"),
                                 "--output-prefix", str(tmp_path / "zh"), "--tokenizer-model",
                                 str(spm_model), "--split-sentences", "--workers", "1",
                                 "--no-progress"]) == 0
    args, _ = add_data_args(argparse.ArgumentParser()).parse_known_args(
        ["--data-path", str(tmp_path / "zh_text_sentence"), "--tokenizer-model", str(spm_model),
         "--t5-objective", "megatron", "--encoder-seq-length", "128",
         "--decoder-seq-length", "64", "--train-iters", "10", "--global-batch-size", "4",
         "--split", "1", "--data-cache-path", str(tmp_path / "cache")])
    train = build_datasets(data_config_from_args(args), corpus[2],
                           sample_counts_from_args(args))["train"]
    assert isinstance(train, MegatronT5Dataset) and len(train) == 40
    sample = train[3]
    assert sample["encoder_input_ids"].shape == (128,) and sample["labels"].shape == (64,)
