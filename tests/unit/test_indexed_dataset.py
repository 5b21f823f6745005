"""The .bin/.idx format: interop with megatron-core (the real peer), legacy TNTIDX, the writer."""

import os
import struct
import warnings

import numpy as np
import pytest

from megatron.data.storage.indexed_dataset import (
    CorruptIndexError,
    IndexedDataset,
    IndexedDatasetBuilder,
    infer_dataset_impl,
    merge_datasets,
    optimal_dtype,
)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import torch
    from megatron.core.datasets import indexed_dataset as mcore


def random_documents(rng, n_docs, max_sentences, vocab):
    """[[sentence tokens, ...], ...] with some empty sentences."""
    docs = []
    for _ in range(n_docs):
        n = int(rng.integers(1, max_sentences + 1))
        docs.append([rng.integers(0, vocab, size=int(rng.integers(0, 40))) for _ in range(n)])
    return docs


def write_ours(prefix, docs, dtype):
    with IndexedDatasetBuilder(prefix + ".bin", dtype=dtype) as b:
        for k, doc in enumerate(docs):
            if k % 2:  # exercise both APIs
                b.add_document(np.concatenate(doc), [len(s) for s in doc])
            else:
                for s in doc:
                    b.add_item(s)
                b.end_document()
        b.finalize(prefix + ".idx")


def write_mcore(prefix, docs, dtype):
    b = mcore.IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in docs:
        b.add_document(torch.from_numpy(np.concatenate(doc).astype(np.int64)),
                       [len(s) for s in doc])
    b.finalize(prefix + ".idx")


def assert_same(ours: IndexedDataset, theirs, docs):
    flat = [s for d in docs for s in d]
    assert len(ours) == len(theirs) == len(flat)
    np.testing.assert_array_equal(ours.sequence_lengths, theirs.sequence_lengths)
    np.testing.assert_array_equal(ours.sequence_pointers, theirs.index.sequence_pointers)
    np.testing.assert_array_equal(ours.document_indices, theirs.document_indices)
    assert ours.num_documents == len(docs)
    for i, s in enumerate(flat):
        assert ours[i].dtype == theirs[i].dtype
        np.testing.assert_array_equal(ours[i], s)
        np.testing.assert_array_equal(theirs[i], s)


# uint16 for a T5 vocabulary, int32 for a large one; sentence level (several sequences per
# document) and document level (one).
@pytest.mark.parametrize("dtype,vocab", [(np.uint16, 32100), (np.int32, 250100)])
@pytest.mark.parametrize("max_sentences", [1, 6])
def test_megatron_core_reads_ours_and_we_read_theirs(tmp_path, dtype, vocab, max_sentences):
    assert optimal_dtype(vocab) == dtype
    docs = random_documents(np.random.default_rng(vocab + max_sentences), 50, max_sentences, vocab)
    ours_prefix, theirs_prefix = str(tmp_path / "ours"), str(tmp_path / "theirs")
    write_ours(ours_prefix, docs, dtype)
    write_mcore(theirs_prefix, docs, dtype)
    for name in (".bin", ".idx"):  # byte for byte the same files
        assert (tmp_path / f"ours{name}").read_bytes() == (tmp_path / f"theirs{name}").read_bytes()
    assert_same(IndexedDataset(ours_prefix), mcore.IndexedDataset(ours_prefix), docs)
    assert_same(IndexedDataset(theirs_prefix), mcore.IndexedDataset(theirs_prefix), docs)


def test_reader_api(tmp_path):
    docs = random_documents(np.random.default_rng(0), 20, 4, 1000)
    prefix = str(tmp_path / "d")
    write_ours(prefix, docs, np.uint16)
    ds = IndexedDataset(prefix, impl="infer")
    flat = [s for d in docs for s in d]
    got = ds[3:9]
    assert len(got) == 6 and all(np.array_equal(a, b) for a, b in zip(got, flat[3:9]))
    assert ds[-1].tolist() == flat[-1].tolist()
    i = next(k for k, s in enumerate(flat) if len(s) > 5)
    np.testing.assert_array_equal(ds.get(i, 2, 3), flat[i][2:5])
    np.testing.assert_array_equal(ds.get(i, 2), flat[i][2:])
    assert ds.num_tokens == sum(len(s) for s in flat)
    assert [len(x) for x in ds.document(1)] == [len(s) for s in docs[1]]
    assert not ds[0].flags.writeable
    with pytest.raises(IndexError):
        ds[len(ds)]
    with pytest.raises(IndexError):
        ds.get(i, 3, len(flat[i]))
    with pytest.raises(ValueError, match="contiguous"):
        ds[0:10:2]
    import pickle

    clone = pickle.loads(pickle.dumps(ds))
    np.testing.assert_array_equal(clone[5], ds[5])


def test_add_index_and_merge(tmp_path):
    rng = np.random.default_rng(1)
    parts = [random_documents(rng, 10, 3, 500) for _ in range(3)]
    prefixes = []
    for k, docs in enumerate(parts):
        prefixes.append(str(tmp_path / f"part{k}"))
        write_ours(prefixes[-1], docs, np.uint16)
    merged = merge_datasets(prefixes, str(tmp_path / "merged"))
    whole = str(tmp_path / "whole")
    write_mcore(whole, [d for docs in parts for d in docs], np.uint16)
    assert (tmp_path / "merged.idx").read_bytes() == (tmp_path / "whole.idx").read_bytes()
    assert (tmp_path / "merged.bin").read_bytes() == (tmp_path / "whole.bin").read_bytes()
    assert merged.num_documents == 30
    write_ours(str(tmp_path / "wide"), parts[0], np.int32)
    with pytest.raises(ValueError, match="dtype"):
        merge_datasets([prefixes[0], str(tmp_path / "wide")], str(tmp_path / "bad"))
    assert not any(p.name.startswith("bad") for p in tmp_path.iterdir())


def test_writer_is_atomic(tmp_path):
    prefix = str(tmp_path / "x")
    with pytest.raises(RuntimeError):
        with IndexedDatasetBuilder(prefix + ".bin", np.uint16) as b:
            b.add_item([1, 2, 3])
            assert os.listdir(tmp_path) != [] and not os.path.exists(prefix + ".bin")
            raise RuntimeError("interrupted")
    assert os.listdir(tmp_path) == []
    with IndexedDatasetBuilder(prefix + ".bin", np.uint16) as b:
        with pytest.raises(ValueError, match="do not fit"):
            b.add_item([70000])
        b.abort()
    assert os.listdir(tmp_path) == []


def write_legacy(prefix, docs, code=4, np_dtype=np.int32):
    """The legacy TNTIDX 'lazy'/'cached' layout, written by hand from its specification."""
    flat = [s for d in docs for s in d]
    lengths = [len(s) for s in flat]
    data_offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    dim_offsets = np.arange(len(flat) + 1, dtype=np.int64)
    doc_idx = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype(np.int64)
    with open(prefix + ".idx", "wb") as f:
        f.write(b"TNTIDX\x00\x00")
        f.write(struct.pack("<QQQ", 1, code, np.dtype(np_dtype).itemsize))
        f.write(struct.pack("<QQ", len(flat), len(flat)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(dim_offsets.tobytes() + data_offsets.tobytes())
        f.write(np.asarray(lengths, dtype=np.int64).tobytes() + doc_idx.tobytes())
    with open(prefix + ".bin", "wb") as f:
        for s in flat:
            f.write(np.asarray(s, dtype=np_dtype).tobytes())


@pytest.mark.parametrize("impl", ["lazy", "cached", "infer"])
def test_legacy_tntidx(tmp_path, impl):
    docs = random_documents(np.random.default_rng(2), 15, 3, 30000)
    prefix = str(tmp_path / "old")
    write_legacy(prefix, docs)
    assert infer_dataset_impl(prefix) == "lazy"
    ds = IndexedDataset(prefix, impl=impl)
    flat = [s for d in docs for s in d]
    assert len(ds) == len(flat) and ds.num_documents == len(docs) and ds.dtype == np.int32
    for i, s in enumerate(flat):
        np.testing.assert_array_equal(ds[i], s)
    with pytest.raises(ValueError, match="--data-impl mmap"):
        IndexedDataset(prefix, impl="mmap")


def test_mmap_file_with_legacy_impl_is_an_error(tmp_path):
    prefix = str(tmp_path / "new")
    write_ours(prefix, [[np.arange(3)]], np.uint16)
    with pytest.raises(ValueError, match="MMIDIDX"):
        IndexedDataset(prefix, impl="cached")
    with pytest.raises(FileNotFoundError, match="nothing.idx"):
        IndexedDataset(str(tmp_path / "nothing"))
    (tmp_path / "junk.idx").write_bytes(b"JUNKJUNKJUNK")
    with pytest.raises(CorruptIndexError, match="junk.idx.*magic"):
        infer_dataset_impl(str(tmp_path / "junk"))


def test_index_without_document_ends(tmp_path):
    """CPM-2's builder never ends documents: document_indices is [0] with N sequences."""
    prefix = str(tmp_path / "cpm2")
    seqs = [np.arange(3), np.arange(5), np.arange(2)]
    with open(prefix + ".bin", "wb") as f:
        for s in seqs:
            f.write(s.astype(np.uint16).tobytes())
    lengths = np.array([3, 5, 2], dtype=np.int32)
    pointers = np.array([0, 6, 16], dtype=np.int64)
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, 3, 1))
        f.write(lengths.tobytes() + pointers.tobytes() + np.zeros(1, np.int64).tobytes())
    with pytest.raises(CorruptIndexError, match="sequences_are_documents=True"):
        IndexedDataset(prefix)
    ds = IndexedDataset(prefix, sequences_are_documents=True)
    assert ds.num_documents == 3 and ds.document_indices.tolist() == [0, 1, 2, 3]
    assert [ds.document(d)[0].tolist() for d in range(3)] == [s.tolist() for s in seqs]
    import pickle

    assert pickle.loads(pickle.dumps(ds)).num_documents == 3
