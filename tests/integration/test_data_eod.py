"""Whether documents end with EOD, decided at open without scanning the data (data_meta.py): the
sidecar preprocess writes, --data-append-eod auto|yes|no, the bounded sample of document ends
(the same bytes for a small and a much larger corpus), Megatron-LM data without a sidecar, the
refusals; and inspect_dataset leaving nothing beside the data."""

import hashlib
import json
import os
import warnings

import numpy as np
import pytest

from data_tools import inspect_dataset, preprocess_data
from megatron.arguments import build_parser, validate
from megatron.data.storage.data_meta import (
    SAMPLE_DOCUMENTS,
    DataMetaError,
    decide_eod,
    meta_file_path,
    read_meta,
)
from megatron.data.storage.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, merge_datasets
from megatron.data.datasets.t5_dataset import T5DatasetConfig, T5SpanCorruptionDataset, T5SpecialTokens
from megatron.data.tokenizers.tokenizer import T5Tokenizer

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import torch
    from megatron.core.datasets import indexed_dataset as mcore


def preprocess(spm_model, corpora_dir, out, name, *extra):
    args = ["--input", str(corpora_dir / "en_shakespeare.jsonl"), "--output-prefix",
            str(out / name), "--tokenizer-model", str(spm_model), "--workers", "1",
            "--no-progress", *extra]
    assert preprocess_data.main(args) == 0
    return str(out / f"{name}_text_document")


@pytest.fixture(scope="module")
def data(spm_model, corpora_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("eod")
    tok = T5Tokenizer(str(spm_model))
    return {"eod": preprocess(spm_model, corpora_dir, out, "eod", "--append-eod"),
            "plain": preprocess(spm_model, corpora_dir, out, "plain"), "tok": tok,
            "tokens": T5SpecialTokens.from_tokenizer(tok), "out": out, "spm": str(spm_model)}


def scanned_needs_eos(prefix, eos_id):
    """The scan this replaces, by hand: a document gets a virtual EOS unless its last token
    (read from the whole .bin) is EOS."""
    ds = IndexedDataset(prefix)
    tokens = np.fromfile(prefix + ".bin", dtype=ds.dtype)
    out = np.ones(ds.num_documents, dtype=bool)
    for d in range(ds.num_documents):
        first, last = ds.document_indices[d], ds.document_indices[d + 1]
        if last > first and ds.sequence_lengths[last - 1] > 0:
            end = ds.sequence_pointers[last - 1] // ds.dtype.itemsize + ds.sequence_lengths[last - 1]
            out[d] = tokens[end - 1] != eos_id
    return out


def copy_without_meta(prefix, folder, name):
    """The dataset's .bin/.idx under another name, without its sidecar (older outputs)."""
    target = str(folder / name)
    for suffix in (".bin", ".idx"):
        with open(prefix + suffix, "rb") as src, open(target + suffix, "wb") as dst:
            dst.write(src.read())
    return target


def test_preprocess_writes_the_sidecar(data):
    for key, appended in (("eod", True), ("plain", False)):
        prefix = data[key]
        meta = read_meta(prefix)
        ds = IndexedDataset(prefix)
        assert (meta.eod_appended, meta.eod_id) == (appended, data["tok"].eos_id)
        assert (meta.documents, meta.sequences, meta.tokens, meta.dtype) == (
            ds.num_documents, len(ds), ds.num_tokens, str(ds.dtype))
        # the pieces: every id below the first sentinel, their text's digest in id order
        pieces = "".join(data["tok"].id_to_piece(i) + "\n" for i in range(4000))
        assert meta.tokenizer == {"type": "SentencePieceTokenizer",
                                  "model": os.path.basename(data["spm"]),
                                  "vocab_size": data["tok"].vocab_size, "pieces": 4000,
                                  "pieces_sha256": hashlib.sha256(pieces.encode()).hexdigest()}
    leftovers = [n for n in os.listdir(data["out"]) if ".tmp-" in n]
    assert leftovers == []


def test_merged_data_keeps_a_sidecar_only_when_its_parts_agree(data, tmp_path):
    twice = str(tmp_path / "twice")
    merged = merge_datasets([data["eod"], data["eod"]], twice)
    meta = read_meta(twice)
    assert meta.eod_appended and (meta.documents, meta.tokens) == (merged.num_documents,
                                                                   merged.num_tokens)
    assert decide_eod(merged, data["tok"].eos_id).source == meta_file_path(twice)
    mixed = str(tmp_path / "mixed")
    merge_datasets([data["eod"], data["plain"]], mixed)
    assert read_meta(mixed) is None


def test_a_failed_preprocess_leaves_no_sidecar(spm_model, tmp_path):
    (tmp_path / "in.jsonl").write_text('{"text": "fine words here"}\nnot json\n')
    code = preprocess_data.main(["--input", str(tmp_path / "in.jsonl"), "--output-prefix",
                                 str(tmp_path / "x"), "--tokenizer-model", str(spm_model),
                                 "--strict", "--workers", "1", "--no-progress"])
    assert code != 0
    assert os.listdir(tmp_path) == ["in.jsonl"]


@pytest.mark.parametrize("key", ["eod", "plain"])
@pytest.mark.parametrize("sidecar", [True, False])
def test_auto_equals_the_scan(data, tmp_path, key, sidecar):
    prefix = data[key] if sidecar else copy_without_meta(data[key], tmp_path, "copy")
    eos = data["tok"].eos_id
    ds = IndexedDataset(prefix)
    decision = decide_eod(ds, eos, "auto")
    assert decision.appended == (key == "eod")
    assert (meta_file_path(prefix) in decision.source) == sidecar
    np.testing.assert_array_equal(decision.needs_eos(ds), scanned_needs_eos(prefix, eos))
    # the sample is bounded: at most SAMPLE_DOCUMENTS tokens of the .bin
    assert len(decision.read_ranges) == min(SAMPLE_DOCUMENTS, ds.num_documents)
    assert all(n == ds.dtype.itemsize for _, n in decision.read_ranges)


@pytest.mark.parametrize("mode,appended", [("yes", True), ("no", False)])
def test_the_flag_settles_it_reading_nothing(data, mode, appended):
    ds = IndexedDataset(data["plain"])
    decision = decide_eod(ds, data["tok"].eos_id, mode)
    assert (decision.appended, decision.read_ranges) == (appended, ())
    assert decision.source == f"--data-append-eod {mode}"


def synthetic(prefix, n_docs, eos, ends_with_eos, seed=3):
    """n_docs random documents (ids 10..999); document d ends with `eos` if ends_with_eos(d)."""
    rng = np.random.default_rng(seed)
    with IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16) as b:
        for d in range(n_docs):
            doc = list(rng.integers(10, 1000, size=int(rng.integers(5, 60))))
            b.add_item(np.asarray(doc + ([eos] if ends_with_eos(d) else []), dtype=np.int64))
            b.end_document()
        b.finalize(prefix + ".idx")
    return prefix


def test_a_sample_that_disagrees_is_refused_naming_the_flag(tmp_path):
    prefix = synthetic(str(tmp_path / "mixed"), 500, 1, lambda d: d % 2 == 0)
    ds = IndexedDataset(prefix)
    with pytest.raises(DataMetaError, match="--data-append-eod yes") as e:
        decide_eod(ds, 1, "auto")
    assert "--data-append-eod no" in str(e.value) and prefix in str(e.value)
    tokens = T5SpecialTokens(0, 1, 0, tuple(range(1999, 1899, -1)))
    with pytest.raises(ValueError, match="--data-append-eod"):
        T5SpanCorruptionDataset("train", ds, (0, 500), 10, T5DatasetConfig(32), tokens,
                                str(tmp_path / "cache"))
    # either answer given, it builds; "no" adds an EOS after every document
    built = T5SpanCorruptionDataset("train", ds, (0, 500), 10, T5DatasetConfig(32), tokens,
                                    str(tmp_path / "cache"), append_eod="no")
    assert built._needs_eos.all()


def base_argv(data, *extra):
    """A small training command line (tests/training/train_workers.py's base_argv)."""
    return ["--data-path", data.prefix, "--tokenizer-model", data.spm,
            "--model-config", data.tiny, "--lr", "3e-3", "--train-iters", "4",
            "--encoder-seq-length", "64", "--split", "90,5,5", "--eval-interval", "2",
            "--eval-iters", "1", "--num-workers", "0", "--data-cache-path", data.cache,
            "--micro-batch-size", "2", "--global-batch-size", "4", *extra]


def test_validation_refuses_before_the_model_is_built(train_data, tmp_path):
    eos = T5Tokenizer(train_data.spm).eos_id
    prefix = synthetic(str(tmp_path / "mixed"), 300, eos, lambda d: d % 3 == 0)
    data = type(train_data)(**{**vars(train_data), "prefix": prefix,
                               "cache": str(tmp_path / "cache")})
    config, problems = validate(build_parser().parse_args(base_argv(data)), {})
    assert config is None
    assert any(p.startswith(f"--data-path {prefix}") and "--data-append-eod" in p
               for p in problems), problems
    config, problems = validate(
        build_parser().parse_args(base_argv(data, "--data-append-eod", "yes")), {})
    assert problems == [] and config.data.dataset.append_eod == "yes"


def test_a_sidecar_that_contradicts_the_data_is_refused(data, tmp_path):
    prefix = copy_without_meta(data["eod"], tmp_path, "liar")
    meta = json.loads(open(meta_file_path(data["eod"])).read())
    eos = data["tok"].eos_id
    for change, words in (({"eod_appended": False}, "says EOD was not appended"),
                          ({"documents": meta["documents"] + 1}, "describes another dataset"),
                          ({"dtype": "int32"}, "describes another dataset")):
        with open(meta_file_path(prefix), "w") as f:
            json.dump({**meta, **change}, f)
        with pytest.raises(DataMetaError, match=words) as e:
            decide_eod(IndexedDataset(prefix), eos, "auto")
        assert meta_file_path(prefix) in str(e.value) and "--data-append-eod" in str(e.value)
    # a sidecar about another tokenizer's EOD says nothing of this one's: the sample decides
    with open(meta_file_path(prefix), "w") as f:
        json.dump({**meta, "eod_id": eos + 5}, f)
    decision = decide_eod(IndexedDataset(prefix), eos, "auto")
    assert decision.appended and "sample" in decision.source
    # and data without EOD that a sidecar says has it
    plain = copy_without_meta(data["plain"], tmp_path, "liar2")
    plain_meta = json.loads(open(meta_file_path(data["plain"])).read())
    with open(meta_file_path(plain), "w") as f:
        json.dump({**plain_meta, "eod_appended": True}, f)
    with pytest.raises(DataMetaError, match="says EOD was appended but 0 of"):
        decide_eod(IndexedDataset(plain), eos, "auto")


def test_bytes_read_at_open_do_not_grow_with_the_corpus(tmp_path):
    ranges = {}
    for name, n_docs in (("small", 200), ("large", 100_000)):
        prefix = synthetic(str(tmp_path / name), n_docs, 1, lambda d: True)
        ds = IndexedDataset(prefix)
        ranges[name] = decide_eod(ds, 1, "auto").read_ranges
    assert os.path.getsize(tmp_path / "large.bin") > 300 * os.path.getsize(tmp_path / "small.bin")
    assert len(ranges["small"]) == len(ranges["large"]) == SAMPLE_DOCUMENTS
    assert sum(n for _, n in ranges["large"]) == SAMPLE_DOCUMENTS * 2


def write_with_megatron_core(prefix, source):
    """The documents of `source` written by megatron-core's builder (Megatron-LM's
    preprocess_data.py writes through it): no sidecar."""
    ds = IndexedDataset(source)
    b = mcore.IndexedDatasetBuilder(prefix + ".bin", dtype=ds.dtype.type)
    for d in range(ds.num_documents):
        seqs = ds.document(d)
        b.add_document(torch.from_numpy(np.concatenate(seqs).astype(np.int64)),
                       [len(s) for s in seqs])
    b.finalize(prefix + ".idx")
    return prefix


@pytest.mark.parametrize("key", ["eod", "plain"])
def test_megatron_lm_data_without_sidecar(data, tmp_path, key):
    theirs = write_with_megatron_core(str(tmp_path / "mcore"), data[key])
    assert not os.path.exists(meta_file_path(theirs))
    cfg = T5DatasetConfig(64, seed=3)
    ours_ds = T5SpanCorruptionDataset("train", IndexedDataset(data[key]), (0, 50), 40, cfg,
                                      data["tokens"], str(tmp_path / "c1"))
    theirs_ds = T5SpanCorruptionDataset("train", IndexedDataset(theirs), (0, 50), 40, cfg,
                                        data["tokens"], str(tmp_path / "c2"))
    assert theirs_ds.eod.appended == (key == "eod") and "sample" in theirs_ds.eod.source
    for i in range(40):
        for k, v in ours_ds[i].items():
            np.testing.assert_array_equal(v, theirs_ds[i][k])


def test_inspect_dataset_writes_nothing_beside_the_data(data, capsys):
    folder = os.path.dirname(data["eod"])
    before = sorted(os.listdir(folder))
    for extra in ([], ["--seed", "5"], ["--encoder-seq-length", "64"]):
        assert inspect_dataset.main([data["eod"], "--tokenizer-model",
                                     data["spm"], "--samples", "2",
                                     *extra]) == 0
    assert sorted(os.listdir(folder)) == before
    assert "sample 1" in capsys.readouterr().out
