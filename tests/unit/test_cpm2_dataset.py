"""CPM2Dataset: CPM-2-Pretrain's offline-corrupted three-file layout."""

from __future__ import annotations

import os

import numpy as np
import pytest

from megatron.data.datasets.cpm2_dataset import CPM2Dataset, cpm2_prefixes, is_cpm2_prefix
from megatron.data.storage.indexed_dataset import IndexedDatasetBuilder, data_file_path, index_file_path
from megatron.data.datasets.t5_dataset import T5SpecialTokens

BASE = 100  # the preprocessing vocabulary size: placeholders are BASE + k
EOD = 7
PAD = 5
START = 1
SENTINELS = (200, 201, 202, 203)
TOKENS = T5SpecialTokens(pad_id=PAD, eos_id=EOD, decoder_start_token_id=START,
                         sentinel_ids=SENTINELS)

# Two documents as CPM-2's writer sees them: raw tokens ending with <eod>, and the noise spans
# [start, end) (kept and noise runs alternate, the last run is noise and holds the <eod>).
DOC_A = ([10, 11, 12, 13, 14, 15, 16, EOD], [(1, 3), (5, 6), (7, 8)])
DOC_B = ([20, 21, 22, EOD], [(1, 2), (3, 4)])
# What the writer stores for them (checked against `corrupt_document` below).
CTX_A, TGT_A, OFF_A = [10, 100, 13, 14, 101, 16, 102], [100, 11, 12, 101, 15, 102, EOD], \
    [0, 3, 3, 2, 5, 2]
CTX_B, TGT_B, OFF_B = [20, 100, 22, 101], [100, 21, 101, EOD], [0, 2, 2, 2]


def corrupt_document(raw, spans, base=BASE):
    """CPM-2's offline corruption of one document: (context, target, offsets)."""
    context, target, offsets, prev = [], [], [], 0
    for k, (s, e) in enumerate(spans):
        context += list(raw[prev:s]) + [base + k]
        offsets += [len(target), 1 + e - s]
        target += [base + k] + list(raw[s:e])
        prev = e
    assert prev == len(raw)
    return context, target, offsets


def write_cpm2(prefix, contexts, targets, offsets, dtype=np.uint16):
    for p, rows in zip(cpm2_prefixes(prefix), (contexts, targets, offsets)):
        builder = IndexedDatasetBuilder(data_file_path(p), dtype=dtype)
        for row in rows:
            builder.add_item(np.asarray(row, dtype=np.int64))
            builder.end_document()
        builder.finalize(index_file_path(p))


def write_docs(prefix, docs):
    parts = [corrupt_document(raw, spans) for raw, spans in docs]
    write_cpm2(prefix, *zip(*parts))


def make(prefix, tmp_path, num_samples, enc, dec, tokens=TOKENS, docs=None, **kw):
    if docs is None:
        docs = (0, kw.pop("num_docs", 2))
    return CPM2Dataset(prefix, docs, num_samples, enc, dec, tokens,
                       cache_dir=str(tmp_path / "cache"), **kw)


def test_writer_layout_matches_hand_made():
    assert corrupt_document(*DOC_A) == (CTX_A, TGT_A, OFF_A)
    assert corrupt_document(*DOC_B) == (CTX_B, TGT_B, OFF_B)


def test_is_cpm2_prefix(tmp_path):
    prefix = str(tmp_path / "corpus_document")
    assert not is_cpm2_prefix(prefix)
    write_docs(prefix, [DOC_A])
    assert is_cpm2_prefix(prefix)
    os.unlink(index_file_path(prefix + "_target_offset"))
    assert not is_cpm2_prefix(prefix)


def test_one_document_windows_overlap_by_one_token(tmp_path):
    prefix = str(tmp_path / "a")
    write_docs(prefix, [DOC_A])
    ds = make(prefix, tmp_path, 2, 4, 6, docs=(0, 1), return_encoder_eod_mask=True)
    assert len(ds) == 2 and ds.num_epochs == 1 and ds.placeholder_base == BASE
    # window 0 = context[0:4], window 1 = context[3:7] (shares the token 14)
    w0, w1 = ds.window(0), ds.window(1)
    np.testing.assert_array_equal(w0["encoder_input_ids"], [10, 200, 13, 14])
    np.testing.assert_array_equal(w0["decoder_input_ids"], [1, 200, 11, 12, PAD, PAD])
    np.testing.assert_array_equal(w0["labels"], [200, 11, 12, 201, -100, -100])
    np.testing.assert_array_equal(w0["encoder_attention_mask"], [1, 1, 1, 1])
    np.testing.assert_array_equal(w0["decoder_attention_mask"], [1, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(w0["encoder_eod_mask"], [0, 0, 0, 0])
    np.testing.assert_array_equal(w1["encoder_input_ids"], [14, 200, 16, 201])
    np.testing.assert_array_equal(w1["decoder_input_ids"], [1, 200, 15, 201, EOD, PAD])
    # the label after the decoder input <eod> (sentinel 202) is not trained, as in CPM-2
    np.testing.assert_array_equal(w1["labels"], [200, 15, 201, EOD, -100, -100])
    np.testing.assert_array_equal(w1["decoder_attention_mask"], [1, 1, 1, 1, 1, 0])
    np.testing.assert_array_equal(w1["encoder_eod_mask"], [0, 0, 0, 1])
    # served in CPM-2's shuffled order
    for i in range(2):
        got, want = ds[i], ds.window(int(ds.shuffle_idx[i]))
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])
    with pytest.raises(IndexError):
        ds[2]


def test_mask_after_eod_off_and_truncation(tmp_path):
    prefix = str(tmp_path / "a")
    write_docs(prefix, [DOC_A])
    ds = make(prefix, tmp_path, 2, 4, 6, docs=(0, 1), mask_after_eod=False)
    np.testing.assert_array_equal(ds.window(1)["labels"], [200, 15, 201, EOD, 202, -100])
    short = make(prefix, tmp_path, 2, 4, 3, docs=(0, 1))
    w1 = short.window(1)  # [<s>] + targets cut to decoder length + 1
    np.testing.assert_array_equal(w1["decoder_input_ids"], [1, 200, 15])
    np.testing.assert_array_equal(w1["labels"], [200, 15, 201])
    np.testing.assert_array_equal(w1["decoder_attention_mask"], [1, 1, 1])


# Hand-computed windows of encoder length 6 over documents A and B, for both document orders.
EXPECTED_AB = {  # order A, B: stream 10 100 13 14 101 16 | 102 20 100 22 101
    0: ([10, 200, 13, 14, 201, 16], [1, 200, 11, 12, 201, 15, PAD, PAD],
        [200, 11, 12, 201, 15, 202, -100, -100]),
    1: ([16, 200, 20, 201, 22, 202], [1, 200, EOD, 201, 21, 202, EOD, PAD],
        [200, EOD, -100, 21, 202, EOD, -100, -100]),
}
EXPECTED_BA = {  # order B, A: stream 20 100 22 101 10 100 | 13 14 101 16 102
    0: ([20, 200, 22, 201, 10, 202], [1, 200, 21, 201, EOD, 202, 11, 12],
        [200, 21, 201, EOD, -100, 11, 12, 203]),
    1: ([200, 13, 14, 201, 16, 202], [1, 200, 11, 12, 201, 15, 202, EOD],
        [200, 11, 12, 201, 15, 202, EOD, -100]),
}


def test_windows_across_documents(tmp_path):
    prefix = str(tmp_path / "ab")
    write_docs(prefix, [DOC_A, DOC_B])
    ds = make(prefix, tmp_path, 2, 6, 8)
    assert ds.num_windows == 2 and sorted(ds.doc_idx.tolist()) == [0, 1]
    expected = EXPECTED_AB if int(ds.doc_idx[0]) == 0 else EXPECTED_BA
    for j, (enc, dec, labels) in expected.items():
        w = ds.window(j)
        np.testing.assert_array_equal(w["encoder_input_ids"], enc)
        np.testing.assert_array_equal(w["decoder_input_ids"], dec)
        np.testing.assert_array_equal(w["labels"], labels)
        assert w["encoder_attention_mask"].tolist() == [1] * 6
    # the other order, by a seed that gives it
    for seed in range(50):
        other = make(prefix, tmp_path, 2, 6, 8, seed=seed)
        if int(other.doc_idx[0]) != int(ds.doc_idx[0]):
            break
    else:
        pytest.fail("no seed gave the other document order")
    expected = EXPECTED_AB if int(other.doc_idx[0]) == 0 else EXPECTED_BA
    for j, (enc, dec, labels) in expected.items():
        w = other.window(j)
        np.testing.assert_array_equal(w["encoder_input_ids"], enc)
        np.testing.assert_array_equal(w["decoder_input_ids"], dec)
        np.testing.assert_array_equal(w["labels"], labels)


def cpm2_reference_order(seed, num_docs, sizes, enc, num_samples):
    """CPM-2's RandomState recipe: documents of all epochs shuffled at once, then the windows."""
    tokens = int(np.sum(sizes))
    epochs = 1
    while (epochs * tokens - 1) // (enc - 1) < num_samples:
        epochs += 1
    rng = np.random.RandomState(seed)
    doc_idx = np.mgrid[0:epochs, 0:num_docs][1].reshape(-1).astype(np.int32)
    rng.shuffle(doc_idx)
    windows = (epochs * tokens - 1) // (enc - 1)
    shuffle_idx = np.arange(windows, dtype=np.uint32)
    rng.shuffle(shuffle_idx)
    return doc_idx, shuffle_idx


def random_corpus(rng, num_docs):
    """Documents as CPM-2 makes them: >= 10 tokens + <eod>, alternating kept / noise runs of
    length >= 1, ending with noise."""
    docs = []
    for _ in range(num_docs):
        n = int(rng.integers(10, 40))
        raw = list(rng.integers(10, BASE, size=n)) + [EOD]
        raw = [t if t != EOD else 8 for t in raw[:-1]] + [EOD]
        cuts = sorted(rng.choice(np.arange(1, len(raw)), size=2 * int(rng.integers(1, 5)) - 1,
                                 replace=False).tolist())
        bounds = cuts + [len(raw)]
        spans = [(bounds[i], bounds[i + 1]) for i in range(0, len(bounds) - 1, 2)]
        docs.append(([int(t) for t in raw], spans))
    return docs


def test_order_matches_cpm2_recipe_and_inverse_restores_text(tmp_path):
    rng = np.random.default_rng(7)
    docs = random_corpus(rng, 12)
    prefix = str(tmp_path / "rand")
    write_docs(prefix, docs)
    tokens = T5SpecialTokens(PAD, EOD, START, tuple(range(1000, 1100)))
    enc, dec, num_samples, seed = 16, 120, 60, 1234
    ds = make(prefix, tmp_path, num_samples, enc, dec, tokens=tokens, docs=(0, len(docs)),
              seed=seed, return_encoder_eod_mask=True)
    ds.validate()
    sizes = [len(corrupt_document(*d)[0]) for d in docs]
    ref_doc, ref_shuffle = cpm2_reference_order(seed, len(docs), sizes, enc, num_samples)
    assert ds.num_epochs > 1
    np.testing.assert_array_equal(ds.doc_idx, ref_doc)
    np.testing.assert_array_equal(ds.shuffle_idx, ref_shuffle)

    # Each context position of each document stands for a piece of the original text.
    pieces_stream = []
    for d in ds.doc_idx:
        raw, spans = docs[int(d)]
        prev = 0
        for s, e in spans:
            pieces_stream += [[t] for t in raw[prev:s]] + [raw[s:e]]
            prev = e
    sentinel_of = {s: i for i, s in enumerate(tokens.sentinel_ids)}
    for i in range(num_samples):
        j = int(ds.shuffle_idx[i])
        s = ds[i]
        assert all(s[k].shape == (enc,) for k in ("encoder_input_ids", "encoder_attention_mask",
                                                  "encoder_eod_mask"))
        assert all(s[k].shape == (dec,) for k in ("decoder_input_ids", "labels",
                                                  "decoder_attention_mask"))
        assert all(s[k].dtype == np.int64 for k in s)
        # the whole target fits decoder length 120 here: rebuild it from the decoder input
        n = int(s["decoder_attention_mask"].sum())
        assert n < dec
        assert s["decoder_input_ids"][0] == START
        target = list(s["decoder_input_ids"][1:n]) + [None]
        labels = s["labels"][:n]
        keep = labels != -100
        np.testing.assert_array_equal(np.asarray(target[:-1])[keep[:-1]], labels[:-1][keep[:-1]])
        # split the target at sentinels: span c follows sentinel c
        spans, current = {}, None
        full = list(s["decoder_input_ids"][1:n])
        last = s["labels"][n - 1]
        full.append(int(last) if last != -100 else None)
        for t in full:
            if t in sentinel_of:
                current = sentinel_of[t]
                spans[current] = []
            elif t is not None:
                spans[current].append(int(t))
        restored, eod_marks = [], []
        for t in s["encoder_input_ids"]:
            if int(t) in sentinel_of:
                restored += spans[sentinel_of[int(t)]]
                eod_marks.append(int(EOD in spans[sentinel_of[int(t)]]))
            else:
                restored.append(int(t))
                eod_marks.append(0)
        window = pieces_stream[j * (enc - 1): j * (enc - 1) + enc]
        assert restored == [t for p in window for t in p]
        assert s["encoder_eod_mask"].tolist() == eod_marks
        # placeholders get sentinels 0, 1, 2, ... in order
        used = [sentinel_of[int(t)] for t in s["encoder_input_ids"] if int(t) in sentinel_of]
        assert used == list(range(len(used)))


def test_pure_function_of_seed_and_index(tmp_path):
    rng = np.random.default_rng(3)
    docs = random_corpus(rng, 8)
    prefix = str(tmp_path / "rand")
    write_docs(prefix, docs)
    tokens = T5SpecialTokens(PAD, EOD, START, tuple(range(1000, 1100)))
    a = make(prefix, tmp_path, 20, 12, 30, tokens=tokens, docs=(0, 8), seed=5)
    b = make(prefix, tmp_path / "other", 20, 12, 30, tokens=tokens, docs=(0, 8), seed=5)
    for i in (19, 0, 7):
        for key, value in a[i].items():
            np.testing.assert_array_equal(value, b[i][key])
    c = make(prefix, tmp_path, 20, 12, 30, tokens=tokens, docs=(0, 8), seed=6)
    assert any(not np.array_equal(a[i]["encoder_input_ids"], c[i]["encoder_input_ids"])
               for i in range(20))


def test_split_range_uses_only_its_documents(tmp_path):
    prefix = str(tmp_path / "ab")
    write_docs(prefix, [DOC_A, DOC_B])
    ds = make(prefix, tmp_path, 1, 4, 6, docs=(1, 2))  # document B only
    np.testing.assert_array_equal(ds.window(0)["encoder_input_ids"], [20, 200, 22, 201])
    with pytest.raises(ValueError, match=r"documents \[1, 1\) hold no context tokens"):
        make(prefix, tmp_path, 1, 4, 6, docs=(1, 1))
    with pytest.raises(ValueError, match="outside the 2 documents"):
        make(prefix, tmp_path, 1, 4, 6, docs=(1, 3))


def test_split_shorter_than_a_window_repeats_its_documents(tmp_path):
    """CPM-2 adds epochs until there are enough windows, even when one epoch holds less than a
    window (its --split 949,50,1 often leaves the valid split that short)."""
    prefix = str(tmp_path / "ab")
    write_docs(prefix, [DOC_A, DOC_B])
    ds = make(prefix, tmp_path, 3, 6, 6, docs=(1, 2))  # document B: 4 context tokens
    assert ds.num_epochs == 4 and ds.num_windows == 3  # (4 * 4 - 1) // 5 windows
    # stream B B B B = 20 100 22 101 | 20 100 22 101 | ...; window 0 holds B and half of B
    w0 = ds.window(0)
    np.testing.assert_array_equal(w0["encoder_input_ids"], [20, 200, 22, 201, 20, 202])
    np.testing.assert_array_equal(w0["decoder_input_ids"], [1, 200, 21, 201, EOD, 202])
    np.testing.assert_array_equal(w0["labels"], [200, 21, 201, EOD, -100, 21])
    # window 1 = 100 22 101 20 100 22: its sentinels count from 0 again
    np.testing.assert_array_equal(ds.window(1)["encoder_input_ids"], [200, 22, 201, 20, 202, 22])


# -- errors ------------------------------------------------------------------------------------


def test_counts_disagree(tmp_path):
    prefix = str(tmp_path / "bad")
    write_cpm2(prefix, [CTX_A, CTX_B], [TGT_A], [OFF_A, OFF_B])
    with pytest.raises(ValueError, match=r"bad_target\.idx has 1"):
        make(prefix, tmp_path, 1, 4, 6)


def test_offset_outside_target(tmp_path):
    prefix = str(tmp_path / "bad")
    write_cpm2(prefix, [CTX_A], [TGT_A], [[0, 3, 3, 2, 5, 9]])
    ds = make(prefix, tmp_path, 2, 4, 6, docs=(0, 1))
    ds.window(0)  # does not touch span 2
    with pytest.raises(ValueError, match=r"bad_target_offset\.bin: document 0 span 2 .*outside"):
        ds.window(1)
    with pytest.raises(ValueError, match=r"bad_target_offset\.bin"):
        ds.validate()


def test_odd_offsets(tmp_path):
    prefix = str(tmp_path / "bad")
    write_cpm2(prefix, [CTX_A], [TGT_A], [[0, 3, 3, 2, 5]])
    with pytest.raises(ValueError, match=r"bad_target_offset\.idx: document 0 has 5 offsets"):
        make(prefix, tmp_path, 2, 4, 6, docs=(0, 1))


def test_placeholder_without_span_and_wrong_span(tmp_path):
    prefix = str(tmp_path / "bad")
    write_cpm2(prefix, [CTX_A], [TGT_A], [[0, 3, 3, 2]])  # span 2 missing
    ds = make(prefix, tmp_path, 2, 4, 6, docs=(0, 1))
    with pytest.raises(ValueError, match=r"bad_context\.bin: document 0 has placeholder 102"):
        ds.window(1)
    prefix2 = str(tmp_path / "bad2")
    write_cpm2(prefix2, [CTX_A], [TGT_A], [[0, 3, 2, 2, 5, 2]])  # span 1 starts at 12
    ds = make(prefix2, tmp_path, 2, 4, 6, docs=(0, 1))
    with pytest.raises(ValueError, match=r"bad2_target\.bin: document 0 span 1 starts with 12"):
        ds.window(1)


def test_more_placeholders_than_sentinels(tmp_path):
    prefix = str(tmp_path / "ab")
    write_docs(prefix, [DOC_A, DOC_B])
    few = T5SpecialTokens(PAD, EOD, START, (200, 201, 202))  # 3 placeholders need 4
    ds = make(prefix, tmp_path, 2, 6, 8, tokens=few)
    with pytest.raises(ValueError, match=r"ab_context\.bin: window \d needs more sentinels"):
        for j in range(ds.num_windows):
            ds.window(j)


def test_eod_in_context_and_missing_file(tmp_path):
    prefix = str(tmp_path / "bad")
    write_cpm2(prefix, [[10, EOD, 100, 14]], [[100, 11]], [[0, 2]])
    ds = make(prefix, tmp_path, 1, 4, 6, docs=(0, 1))
    with pytest.raises(ValueError, match=r"bad_context\.bin: document 0 has <eod>"):
        ds.window(0)
    os.unlink(data_file_path(prefix + "_target"))
    with pytest.raises(FileNotFoundError, match=r"bad_target\.bin"):
        make(prefix, tmp_path, 1, 4, 6, docs=(0, 1))


def unclose_documents(prefix):
    """Rewrite PREFIX.idx as CPM-2's builder leaves it: document_indices [0] for N sequences."""
    import struct
    path = index_file_path(prefix)
    with open(path, "rb") as f:
        raw = f.read()
    n = struct.unpack("<Q", raw[18:26])[0]
    with open(path, "wb") as f:
        f.write(raw[:26] + struct.pack("<Q", 1) + raw[34:34 + 12 * n] + struct.pack("<q", 0))


def test_reads_cpm2_index_without_document_boundaries(tmp_path):
    from megatron.data.storage.indexed_dataset import CorruptIndexError, IndexedDataset
    prefix = str(tmp_path / "ab")
    write_docs(prefix, [DOC_A, DOC_B])
    for p in cpm2_prefixes(prefix):
        unclose_documents(p)
    with pytest.raises(CorruptIndexError):
        IndexedDataset(prefix + "_context")  # our checked reader refuses it ...
    ds = make(prefix, tmp_path, 2, 6, 8)  # ... the CPM-2 dataset reads it
    assert len(ds.context) == 2 and ds.context.get(1).tolist() == CTX_B
    assert ds.target.get(0, 3, 2).tolist() == [101, 15]
    ds.validate()
    expected = EXPECTED_AB if int(ds.doc_idx[0]) == 0 else EXPECTED_BA
    for j, (enc, dec, labels) in expected.items():
        w = ds.window(j)
        np.testing.assert_array_equal(w["encoder_input_ids"], enc)
        np.testing.assert_array_equal(w["labels"], labels)
    import pickle
    again = pickle.loads(pickle.dumps(ds))
    for key, value in ds[1].items():
        np.testing.assert_array_equal(again[1][key], value)
    # a truncated index is still an error that names the file
    path = index_file_path(prefix + "_target")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 4)
    with pytest.raises(CorruptIndexError, match=r"ab_target\.idx"):
        make(prefix, tmp_path, 2, 6, 8)


def test_build_datasets_recognises_cpm2_files(tmp_path):
    from megatron.data.datasets.builder import DataConfig, build_datasets
    from megatron.data.datasets.t5_dataset import T5DatasetConfig

    prefix = str(tmp_path / "corpus_document")
    write_docs(prefix, random_corpus(np.random.default_rng(3), 40))
    tokens = T5SpecialTokens(pad_id=PAD, eos_id=EOD, decoder_start_token_id=START,
                             sentinel_ids=tuple(range(200, 220)))
    t5 = T5DatasetConfig(encoder_seq_length=16, decoder_seq_length=12, seed=5)
    config = DataConfig(data_path=[prefix], split="90,10,0", t5=t5,
                        data_cache_path=str(tmp_path / "cache"))
    built = build_datasets(config, tokens, (20, 4, 0))
    direct = CPM2Dataset(prefix, (0, 36), 20, 16, 12, tokens, seed=5,
                         cache_dir=str(tmp_path / "cache2"))
    assert isinstance(built["train"], CPM2Dataset) and built["test"] is None
    for i in range(20):
        for key, value in direct[i].items():
            np.testing.assert_array_equal(built["train"][i][key], value)
    with pytest.raises(ValueError, match="needs --decoder-seq-length"):
        build_datasets(DataConfig(data_path=[prefix], t5=T5DatasetConfig(16)), tokens,
                       (20, 0, 0))
