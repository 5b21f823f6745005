"""The C++ index builders (csrc/builders.cpp) against plain Python/numpy references.

Each builder is compared bit for bit with a straightforward reference written here, on small random
inputs over several seeds, and checked for the properties the datasets rely on; invalid arguments
must raise ValueError (never crash).
"""

import glob
import importlib.util
import os
import threading

import numpy as np
import pytest

from megatron.data import _helpers as H

SEEDS = range(6)
M64 = (1 << 64) - 1


# ------------------------------------------------------------------------------------------------
# References


class MT19937_64:
    """std::mt19937_64 (the C++ standard's 64-bit Mersenne Twister), in plain Python."""

    def __init__(self, seed):
        self.mt = [seed & M64]
        for i in range(1, 312):
            prev = self.mt[-1]
            self.mt.append((6364136223846793005 * (prev ^ (prev >> 62)) + i) & M64)
        self.i = 312

    def __call__(self):
        if self.i == 312:
            mt = self.mt
            for i in range(312):
                x = (mt[i] & 0xFFFFFFFF80000000) | (mt[(i + 1) % 312] & 0x7FFFFFFF)
                mt[i] = mt[(i + 156) % 312] ^ (x >> 1) ^ (0xB5026F5AA96619E9 if x & 1 else 0)
            self.i = 0
        y = self.mt[self.i]
        self.i += 1
        y ^= (y >> 29) & 0x5555555555555555
        y ^= (y << 17) & 0x71D67FFFEDA60000
        y ^= (y << 37) & 0xFFF7EEE000000000
        return y ^ (y >> 43)

    def below(self, m):
        threshold = (2**64 - m) % m
        while True:
            r = self()
            if r >= threshold:
                return r % m


def ref_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch, drop_last=True,
                   add_extra=True):
    """Rows located by binary search in the cumulative token counts of the stream."""
    extra = int(add_extra)
    total = num_epochs * tokens_per_epoch
    usable = total - extra
    if usable <= 0:
        num_samples = 0
    elif drop_last:
        num_samples = usable // seq_length
    else:
        num_samples = -(-usable // seq_length)
    starts = np.concatenate([[0], np.cumsum(sizes[doc_idx].astype(np.int64))])
    rows = [(0, 0)]
    for j in range(1, num_samples + 1):
        p = min(j * seq_length, usable)
        # The document holding token p (extra) or token p - 1 (no extra): the last start <= it.
        k = int(np.searchsorted(starts, p - 1 + extra, side="right")) - 1
        rows.append((k, p - int(starts[k])))
    return np.array(rows, dtype=np.int64)


def ref_blend(weights, size):
    w = [float(x) for x in weights]
    total = 0.0
    for x in w:  # left to right, as the C++ does (numpy's sum is pairwise)
        total += x
    w = np.array(w) / total
    taken = np.zeros(len(w), dtype=np.int64)
    index, sample = [], []
    for i in range(size):
        error = w * float(i + 1) - taken.astype(np.float64)
        k = int(np.argmax(error))  # the first of equal maxima
        index.append(k)
        sample.append(taken[k])
        taken[k] += 1
    return np.array(index, dtype=np.int32), np.array(sample, dtype=np.int64)


def ref_exhaustive(sizes):
    """ref_blend's rule with w[k] = sizes[k] / total, never choosing an exhausted dataset."""
    total = sum(int(s) for s in sizes)
    if total == 0:
        return np.zeros(0, np.int32), np.zeros(0, np.int64)
    weights = np.array([float(int(s)) for s in sizes]) / float(total)
    caps = np.asarray(sizes, dtype=np.int64)
    taken = np.zeros(len(caps), dtype=np.int64)
    index, sample = [], []
    for i in range(total):
        error = weights * float(i + 1) - taken.astype(np.float64)
        error[taken >= caps] = -np.inf
        k = int(np.argmax(error))
        index.append(k)
        sample.append(taken[k])
        taken[k] += 1
    return np.array(index, dtype=np.int32), np.array(sample, dtype=np.int64)


def ref_mapping(docs, sizes, num_epochs, max_num_samples, max_seq_length, short_seq_prob, seed,
                min_num_sent=2, long_sentence_len=512):
    gen = MT19937_64(seed)
    docs = [int(d) for d in docs]
    sizes = [int(s) for s in sizes]
    kept = [d for d in range(len(docs) - 1)
            if docs[d + 1] - docs[d] >= min_num_sent
            and all(sizes[s] <= long_sentence_len for s in range(docs[d], docs[d + 1]))]
    rows = []
    for _ in range(num_epochs):
        if len(rows) >= max_num_samples or not kept:
            break
        for d in kept:
            s, last = docs[d], docs[d + 1]
            while s < last and len(rows) < max_num_samples:
                target = max_seq_length
                if short_seq_prob > 0 and (gen() >> 11) * 2.0**-53 < short_seq_prob:
                    target = 2 + gen.below(max_seq_length - 1)
                start, tokens = s, 0
                while True:
                    tokens += sizes[s]
                    s += 1
                    if s == last or (tokens >= target and s - start >= min_num_sent
                                     and last - s >= min_num_sent):
                        break
                rows.append((start, s, target))
    for i in range(len(rows) - 1, 0, -1):
        j = gen.below(i + 1)
        rows[i], rows[j] = rows[j], rows[i]
    return np.array(rows, dtype=np.uint64).reshape(-1, 3)


def test_mt19937_64_reference():
    """The reference generator is std::mt19937_64: the standard's 10000th output, default seed."""
    gen = MT19937_64(5489)
    for _ in range(9999):
        gen()
    assert gen() == 9981545732273789042


# ------------------------------------------------------------------------------------------------
# build_sample_idx


def random_corpus(rng, n_docs=30, max_len=20, epochs=1, empty=True):
    sizes = rng.integers(0 if empty else 1, max_len, size=n_docs).astype(np.int32)
    doc_idx = np.concatenate([rng.permutation(n_docs) for _ in range(epochs)]).astype(np.int64)
    return sizes, doc_idx


def gather(tokens, doc_idx, rows, j, extra, total):
    """The tokens of sample j as a dataset reads them: from row j to row j+1 (+ extra)."""
    (k0, o0), (k1, o1) = rows[j], rows[j + 1]
    end = o1 + extra
    if k0 == k1:
        return tokens[doc_idx[k0]][o0:end]
    parts = [tokens[doc_idx[k0]][o0:]]
    parts += [tokens[doc_idx[k]] for k in range(k0 + 1, k1)]
    parts.append(tokens[doc_idx[k1]][:end])
    return np.concatenate(parts)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("add_extra", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
def test_sample_idx_matches_reference_and_stream(seed, add_extra, drop_last):
    rng = np.random.default_rng(seed)
    epochs = int(rng.integers(1, 4))
    sizes, doc_idx = random_corpus(rng, n_docs=int(rng.integers(1, 40)), epochs=epochs)
    if sizes.sum() < 2:
        sizes[0] = 5
    per_epoch = int(sizes.sum())
    extra = int(add_extra)
    tokens = [rng.integers(0, 1000, size=s) for s in sizes]
    stream = np.concatenate([tokens[d] for d in doc_idx])
    for seq_length in (1, 2, 3, 7, 16, 64, 1000):
        got = H.build_sample_idx(sizes, doc_idx, seq_length, epochs, per_epoch, drop_last,
                                 add_extra)
        want = ref_sample_idx(sizes, doc_idx, seq_length, epochs, per_epoch, drop_last, add_extra)
        assert got.dtype == np.int64 and got.flags.c_contiguous
        np.testing.assert_array_equal(got, want)
        total = epochs * per_epoch
        for j in range(len(got) - 1):
            sample = gather(tokens, doc_idx, got, j, extra, total)
            begin = j * seq_length
            np.testing.assert_array_equal(sample, stream[begin:min(begin + seq_length + extra,
                                                                   total)])
        if drop_last:
            assert all(len(gather(tokens, doc_idx, got, j, extra, total)) == seq_length + extra
                       for j in range(len(got) - 1))
        else:
            assert (len(got) - 1) * seq_length >= total - extra


def test_sample_idx_uses_only_the_first_total_tokens():
    sizes = np.array([5, 5, 5, 5], dtype=np.int32)
    doc_idx = np.arange(4, dtype=np.int64)
    got = H.build_sample_idx(sizes, doc_idx, 4, 1, 10, False, False)  # 10 of the 20 tokens
    np.testing.assert_array_equal(got, [[0, 0], [0, 4], [1, 3], [1, 5]])
    np.testing.assert_array_equal(got, ref_sample_idx(sizes, doc_idx, 4, 1, 10, False, False))


def test_sample_idx_no_samples():
    sizes = np.array([3], dtype=np.int32)
    got = H.build_sample_idx(sizes, np.zeros(1, np.int64), 8, 1, 3)
    np.testing.assert_array_equal(got, [[0, 0]])
    got = H.build_sample_idx(sizes, np.zeros(0, np.int64), 8, 1, 0, True, False)
    assert got.shape == (1, 2)


def megatron_core_helpers():
    """megatron-core's compiled helpers, loaded directly (importing megatron.core is slow).
    megatron-core is a test dependency (setup.py's "test" extra) and its wheel ships the
    compiled helpers_cpp: either missing is a failure, not a reason to skip."""
    spec = importlib.util.find_spec("megatron.core")
    assert spec is not None, "megatron-core is not installed (pip install -e '.[test]')"
    folder = os.path.join(list(spec.submodule_search_locations)[0], "datasets")
    paths = glob.glob(os.path.join(folder, "helpers_cpp*.so"))
    assert paths, f"megatron-core has no compiled helpers_cpp in {folder}"
    spec = importlib.util.spec_from_file_location("helpers_cpp", paths[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("add_extra", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
def test_sample_idx_matches_megatron_core(add_extra, drop_last):
    """Same rows as megatron-core's build_sample_idx (where that is well defined: the stream
    holds exactly num_epochs * tokens_per_epoch tokens and its last document is not empty)."""
    mc = megatron_core_helpers()
    for seed in SEEDS:
        rng = np.random.default_rng(100 + seed)
        epochs = int(rng.integers(1, 4))
        sizes, doc_idx = random_corpus(rng, n_docs=int(rng.integers(2, 40)), epochs=epochs)
        sizes[doc_idx[-1]] = max(sizes[doc_idx[-1]], 1)
        per_epoch = int(sizes.sum())
        for seq_length in (2, 3, 8, 33):
            ours = H.build_sample_idx(sizes, doc_idx, seq_length, epochs, per_epoch, drop_last,
                                      add_extra)
            theirs = mc.build_sample_idx_int64(sizes, doc_idx.astype(np.int32), seq_length,
                                               epochs, per_epoch, drop_last, int(add_extra))
            np.testing.assert_array_equal(ours, theirs)


# ------------------------------------------------------------------------------------------------
# Blending


def prefix_deviation(index, weights):
    """counts[i, k] - w[k] * (i + 1) for every prefix."""
    w = np.asarray(weights, dtype=np.float64) / np.sum(weights)
    onehot = np.zeros((len(index), len(w)))
    onehot[np.arange(len(index)), index] = 1
    return np.cumsum(onehot, axis=0) - w * np.arange(1, len(index) + 1)[:, None]


@pytest.mark.parametrize("seed", SEEDS)
def test_blending_matches_reference(seed):
    rng = np.random.default_rng(seed)
    for K in (1, 2, 3, 7, 40):
        weights = rng.random(K) ** int(rng.integers(1, 6))
        weights[rng.random(K) < 0.2] = 0.0
        if not weights.any():
            weights[0] = 0.5
        size = int(rng.integers(0, 1500))
        index, sample = H.build_blending_indices(weights, size)
        want_index, want_sample = ref_blend(weights, size)
        assert index.dtype == np.int32 and sample.dtype == np.int64
        np.testing.assert_array_equal(index, want_index)
        np.testing.assert_array_equal(sample, want_sample)
        # Each dataset's samples are numbered 0, 1, 2, ... in order; zero weights never chosen.
        for k in range(K):
            np.testing.assert_array_equal(sample[index == k], np.arange((index == k).sum()))
        assert not np.isin(index, np.flatnonzero(weights == 0)).any()
        if size:
            dev = prefix_deviation(index, weights)
            # Provable: the chosen dataset's error is >= 1/K (the errors sum to 1), so no
            # dataset ever gets more than 1 - 1/K samples ahead of its share.
            assert dev.max() <= 1 - 1 / K + 1e-9
            if K <= 2:
                assert np.abs(dev).max() <= 0.5 + 1e-9


def test_blending_unnormalised_weights_and_ties():
    index, sample = H.build_blending_indices(np.array([3.0, 3.0, 6.0]), 8)
    np.testing.assert_array_equal(index, [2, 0, 1, 2, 2, 0, 1, 2])
    np.testing.assert_array_equal(sample, [0, 0, 0, 1, 2, 1, 1, 3])
    index, _ = H.build_blending_indices(np.array([1.0, 1.0, 1.0, 1.0]), 12)
    np.testing.assert_array_equal(index, [0, 1, 2, 3] * 3)


def test_blending_lag_can_exceed_one_sample():
    """The greedy rule keeps every dataset within 1 - 1/K samples *ahead* of its share, but a
    dataset can fall slightly more than one sample *behind* (here 43/42 after 163 samples)."""
    weights = np.array([225.0, 144.0, 4.0, 4.0, 1.0])
    index, sample = H.build_blending_indices(weights, 378)
    want_index, want_sample = ref_blend(weights, 378)
    np.testing.assert_array_equal(index, want_index)
    dev = prefix_deviation(index, weights)
    assert dev[162, 0] == pytest.approx(-43 / 42)
    assert dev.max() <= 1 - 1 / 5 + 1e-9 and dev.min() > -1.1
    np.testing.assert_array_equal(np.bincount(index, minlength=5), [225, 144, 4, 4, 1])


def test_blending_more_than_256_datasets():
    rng = np.random.default_rng(7)
    weights = rng.random(1000)
    index, sample = H.build_blending_indices(weights, 4000)
    want_index, want_sample = ref_blend(weights, 4000)
    np.testing.assert_array_equal(index, want_index)
    np.testing.assert_array_equal(sample, want_sample)
    assert index.max() > 255 and len(np.unique(index)) > 900
    assert prefix_deviation(index, weights).max() <= 1 - 1 / 1000 + 1e-9


@pytest.mark.parametrize("seed", SEEDS)
def test_exhaustive_blending(seed):
    rng = np.random.default_rng(seed)
    for K in (1, 2, 5, 30):
        sizes = rng.integers(0, 80, size=K).astype(np.int64)
        if rng.random() < 0.5:
            sizes[rng.integers(K)] = 0
        index, sample = H.build_exhaustive_blending_indices(sizes)
        want_index, want_sample = ref_exhaustive(sizes)
        assert index.dtype == np.int32 and sample.dtype == np.int64
        np.testing.assert_array_equal(index, want_index)
        np.testing.assert_array_equal(sample, want_sample)
        assert len(index) == sizes.sum()
        # Every sample of every dataset exactly once, in order.
        for k in range(K):
            np.testing.assert_array_equal(sample[index == k], np.arange(sizes[k]))
        if len(index):
            assert prefix_deviation(index, sizes).max() <= 1 - 1 / K + 1e-9


def test_exhaustive_blending_many_datasets_and_edges():
    sizes = np.array([1, 2, 3] * 150, dtype=np.int64)  # 450 datasets
    index, sample = H.build_exhaustive_blending_indices(sizes)
    np.testing.assert_array_equal(np.bincount(index, minlength=450), sizes)
    assert index.max() == 449
    np.testing.assert_array_equal(index, ref_exhaustive(sizes)[0])
    index, sample = H.build_exhaustive_blending_indices(np.zeros(3, np.int64))
    assert index.shape == sample.shape == (0,)
    index, _ = H.build_exhaustive_blending_indices(np.array([0, 4], np.int64))
    np.testing.assert_array_equal(index, [1, 1, 1, 1])


# ------------------------------------------------------------------------------------------------
# build_mapping


def random_sentences(rng, n_docs=25, max_sent=8, max_len=60):
    counts = rng.integers(0, max_sent, size=n_docs)
    docs = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    sizes = rng.integers(0, max_len, size=int(docs[-1])).astype(np.int32)
    return docs, sizes


def check_mapping_rows(rows, docs, sizes, max_seq_length, min_num_sent, long_sentence_len=512):
    docs = np.asarray(docs)
    for start, end, target in rows.astype(np.int64):
        d = int(np.searchsorted(docs, start, side="right")) - 1
        first, last = docs[d], docs[d + 1]
        assert first <= start < end <= last  # inside one document
        assert last - first >= min_num_sent
        assert sizes[first:last].max() <= long_sentence_len
        assert 2 <= target <= max_seq_length
        assert end - start >= min_num_sent
        if end < last:  # closed early: reached its target, and no further sentence was needed
            tokens = int(sizes[start:end].sum())
            assert tokens >= target and last - end >= min_num_sent
            assert tokens - sizes[end - 1] < target or end - 1 - start < min_num_sent


@pytest.mark.parametrize("seed", SEEDS)
def test_mapping_matches_reference(seed):
    rng = np.random.default_rng(seed)
    docs, sizes = random_sentences(rng)
    for min_num_sent in (1, 2, 3):
        for short_seq_prob in (0.0, 0.1, 0.5, 1.0):
            for num_epochs, max_num_samples in ((1, 10**9), (3, 10**9), (5, 37), (2, 0)):
                max_seq_length = int(rng.integers(2, 200))
                args = (docs, sizes, num_epochs, max_num_samples, max_seq_length, short_seq_prob,
                        seed * 1000 + 17, min_num_sent, 50)
                got = H.build_mapping(*args)
                want = ref_mapping(*args)
                assert got.dtype == np.uint64 and got.ndim == 2 and got.shape[1] == 3
                np.testing.assert_array_equal(got, want)
                assert len(got) <= max_num_samples
                check_mapping_rows(got, docs, sizes, max_seq_length, min_num_sent, 50)
                if short_seq_prob == 0.0 and len(got):
                    assert (got[:, 2] == max_seq_length).all()


def test_mapping_epochs_partition_documents():
    """Without short targets every epoch makes the same rows, which tile each kept document."""
    rng = np.random.default_rng(11)
    docs, sizes = random_sentences(rng, n_docs=40)
    one = H.build_mapping(docs, sizes, 1, 10**9, 100, 0.0, 3)
    three = H.build_mapping(docs, sizes, 3, 10**9, 100, 0.0, 3)
    rows_one = sorted(map(tuple, one.tolist()))
    assert sorted(map(tuple, three.tolist())) == sorted(rows_one * 3)
    covered = np.zeros(len(sizes), dtype=int)
    for start, end, _ in rows_one:
        covered[start:end] += 1
    for d in range(len(docs) - 1):
        first, last = docs[d], docs[d + 1]
        keep = last - first >= 2 and (last == first or sizes[first:last].max() <= 512)
        assert (covered[first:last] == int(keep)).all()


def test_mapping_seed_and_limits():
    rng = np.random.default_rng(5)
    docs, sizes = random_sentences(rng, n_docs=60)
    args = (docs, sizes, 4, 10**9, 64, 0.1)
    a = H.build_mapping(*args, 1234)
    np.testing.assert_array_equal(a, H.build_mapping(*args, 1234))
    b = H.build_mapping(*args, 1235)
    assert len(a) > 50 and not np.array_equal(a, b)
    # Rows stop at exactly max_num_samples, even mid-epoch.
    assert len(H.build_mapping(docs, sizes, 10**6, 1000, 64, 0.1, 1)) == 1000
    # Huge num_epochs when nothing qualifies: stops after the first (empty) epoch.
    none = H.build_mapping(docs, sizes, 2**31 - 1, 2**62, 64, 0.1, 1, min_num_sent=10**6)
    assert none.shape == (0, 3) and none.dtype == np.uint64
    # Short targets come with about short_seq_prob and are uniform in [2, max_seq_length].
    rows = H.build_mapping(docs, sizes, 200, 10**9, 64, 0.25, 9)
    short = rows[:, 2] < 64
    assert 0.2 < short.mean() < 0.3 and rows[:, 2].min() == 2


def test_mapping_groups_like_megatron_core():
    """With min_num_sent=2 and full-length targets the rows are megatron-core's, up to order
    (its generators differ: it shuffles with mt19937_64(seed + 1))."""
    mc = megatron_core_helpers()
    for seed in SEEDS:
        rng = np.random.default_rng(200 + seed)
        docs, sizes = random_sentences(rng, n_docs=50, max_len=200)
        sizes[rng.random(len(sizes)) < 0.02] = 600  # a few documents with long sentences
        for num_epochs, max_seq_length in ((1, 64), (3, 300)):
            ours = H.build_mapping(docs, sizes, num_epochs, 10**9, max_seq_length, 0.0, seed + 1)
            theirs = mc.build_mapping(docs, sizes, num_epochs, 10**9, max_seq_length, 0.0,
                                      seed + 1, False, 2)
            assert sorted(map(tuple, ours.tolist())) == sorted(map(tuple, theirs.tolist()))


def test_mapping_long_sentences_skip_documents():
    docs = np.array([0, 3, 6, 6, 7], dtype=np.int64)
    sizes = np.array([10, 600, 10, 10, 10, 10, 700], dtype=np.int32)
    rows = H.build_mapping(docs, sizes, 1, 100, 8, 0.0, 0)
    np.testing.assert_array_equal(rows, [[3, 6, 8]])  # doc 0: long sentence; doc 3: one sentence
    rows = H.build_mapping(docs, sizes, 1, 100, 8, 0.0, 0, 1, 10**6)
    # min_num_sent=1 and no length limit: every document, one sentence per row (each >= 8).
    assert sorted(map(tuple, rows.tolist())) == [(s, s + 1, 8) for s in range(7)]


# ------------------------------------------------------------------------------------------------
# Invalid arguments


def i32(*values):
    return np.array(values, dtype=np.int32)


def i64(*values):
    return np.array(values, dtype=np.int64)


SIZES, DOC_IDX = i32(3, 4, 5), i64(0, 1, 2)
DOCS, SENT = i64(0, 2, 4), i32(3, 4, 5, 6)
BAD_CALLS = {
    "sizes dtype": lambda: H.build_sample_idx(SIZES.astype(np.int64), DOC_IDX, 4, 1, 12),
    "sizes list": lambda: H.build_sample_idx([3, 4, 5], DOC_IDX, 4, 1, 12),
    "sizes byte order": lambda: H.build_sample_idx(SIZES.astype(">i4"), DOC_IDX, 4, 1, 12),
    "doc_idx dtype": lambda: H.build_sample_idx(SIZES, DOC_IDX.astype(np.int32), 4, 1, 12),
    "sizes 2-D": lambda: H.build_sample_idx(SIZES.reshape(1, 3), DOC_IDX, 4, 1, 12),
    "doc_idx strided": lambda: H.build_sample_idx(SIZES, i64(0, 9, 1, 9, 2, 9)[::2], 4, 1, 12),
    "negative size": lambda: H.build_sample_idx(i32(3, -4, 5), DOC_IDX, 4, 1, 4),
    "doc_idx out of range": lambda: H.build_sample_idx(SIZES, i64(0, 1, 3), 4, 1, 4),
    "doc_idx negative": lambda: H.build_sample_idx(SIZES, i64(0, -1, 2), 4, 1, 4),
    "seq_length 0": lambda: H.build_sample_idx(SIZES, DOC_IDX, 0, 1, 12),
    "num_epochs 0": lambda: H.build_sample_idx(SIZES, DOC_IDX, 4, 0, 12),
    "tokens_per_epoch negative": lambda: H.build_sample_idx(SIZES, DOC_IDX, 4, 1, -1),
    "too few tokens": lambda: H.build_sample_idx(SIZES, DOC_IDX, 4, 2, 12),
    "epoch overflow": lambda: H.build_sample_idx(SIZES, DOC_IDX, 4, 2**40, 2**40),
    "weights empty": lambda: H.build_blending_indices(np.zeros(0), 5),
    "weights NaN": lambda: H.build_blending_indices(np.array([0.5, np.nan]), 5),
    "weights inf": lambda: H.build_blending_indices(np.array([0.5, np.inf]), 5),
    "weights negative": lambda: H.build_blending_indices(np.array([0.5, -0.1]), 5),
    "weights all zero": lambda: H.build_blending_indices(np.zeros(3), 5),
    "weights sum overflow": lambda: H.build_blending_indices(np.array([1e308, 1e308]), 5),
    "weights float32": lambda: H.build_blending_indices(np.ones(3, np.float32), 5),
    "weights 2-D": lambda: H.build_blending_indices(np.ones((2, 2)), 5),
    "size negative": lambda: H.build_blending_indices(np.ones(2), -1),
    "exhaustive empty": lambda: H.build_exhaustive_blending_indices(i64()),
    "exhaustive negative": lambda: H.build_exhaustive_blending_indices(i64(3, -1)),
    "exhaustive dtype": lambda: H.build_exhaustive_blending_indices(i32(3, 1)),
    "exhaustive overflow": lambda: H.build_exhaustive_blending_indices(i64(2**62, 2**62)),
    "docs dtype": lambda: H.build_mapping(DOCS.astype(np.int32), SENT, 1, 10, 8, 0.1, 1),
    "docs empty": lambda: H.build_mapping(i64(), SENT, 1, 10, 8, 0.1, 1),
    "docs decreasing": lambda: H.build_mapping(i64(0, 3, 2, 4), SENT, 1, 10, 8, 0.1, 1),
    "docs negative": lambda: H.build_mapping(i64(-1, 2, 4), SENT, 1, 10, 8, 0.1, 1),
    "docs past sizes": lambda: H.build_mapping(i64(0, 2, 5), SENT, 1, 10, 8, 0.1, 1),
    "sentence size negative": lambda: H.build_mapping(DOCS, i32(3, -4, 5, 6), 1, 10, 8, 0.1, 1),
    "mapping sizes dtype": lambda: H.build_mapping(DOCS, SENT.astype(np.int64), 1, 10, 8, 0.1, 1),
    "mapping epochs": lambda: H.build_mapping(DOCS, SENT, 0, 10, 8, 0.1, 1),
    "max_num_samples": lambda: H.build_mapping(DOCS, SENT, 1, -1, 8, 0.1, 1),
    "max_seq_length": lambda: H.build_mapping(DOCS, SENT, 1, 10, 1, 0.1, 1),
    "max_seq_length huge": lambda: H.build_mapping(DOCS, SENT, 1, 10, 2**31, 0.1, 1),
    "short_seq_prob": lambda: H.build_mapping(DOCS, SENT, 1, 10, 8, 1.5, 1),
    "short_seq_prob NaN": lambda: H.build_mapping(DOCS, SENT, 1, 10, 8, float("nan"), 1),
    "seed": lambda: H.build_mapping(DOCS, SENT, 1, 10, 8, 0.1, -1),
    "min_num_sent": lambda: H.build_mapping(DOCS, SENT, 1, 10, 8, 0.1, 1, 0),
    "long_sentence_len": lambda: H.build_mapping(DOCS, SENT, 1, 10, 8, 0.1, 1, 2, 0),
}


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_invalid_arguments_raise_value_error(name):
    with pytest.raises(ValueError) as info:
        BAD_CALLS[name]()
    assert "argument '" in str(info.value)


def test_error_messages_name_the_problem():
    with pytest.raises(ValueError, match=r"build_sample_idx\(\): argument 'doc_idx': doc_idx\[2\] "
                                         r"= 3 is not an index into sizes \(length 3\)"):
        BAD_CALLS["doc_idx out of range"]()
    with pytest.raises(ValueError, match="argument 'weights': weights\\[1\\] = nan"):
        BAD_CALLS["weights NaN"]()
    with pytest.raises(ValueError, match="must have dtype int64 .*got int32"):
        BAD_CALLS["doc_idx dtype"]()
    with pytest.raises(ValueError, match="C-contiguous"):
        BAD_CALLS["doc_idx strided"]()


def test_accepts_read_only_and_memmap_like_inputs(tmp_path):
    sizes = np.lib.format.open_memmap(tmp_path / "s.npy", mode="w+", dtype=np.int32, shape=(3,))
    sizes[:] = [3, 4, 5]
    doc_idx = DOC_IDX.copy()
    doc_idx.flags.writeable = False
    np.testing.assert_array_equal(H.build_sample_idx(sizes, doc_idx, 4, 1, 12),
                                  ref_sample_idx(np.asarray(sizes), doc_idx, 4, 1, 12))


def test_long_builds_release_the_gil():
    """Another Python thread keeps running while a long blend runs."""
    ticks = []
    done = threading.Event()

    def build():
        H.build_blending_indices(np.ones(500), 400_000)
        done.set()

    worker = threading.Thread(target=build)
    worker.start()
    while not done.is_set():
        ticks.append(1)
        done.wait(0.001)
    worker.join()
    assert len(ticks) > 5
