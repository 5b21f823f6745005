"""MegatronT5Dataset: Megatron-style n-gram masked T5 samples over sentence-level data."""

import math

import numpy as np
import pytest

from megatron.data.storage.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron.data.datasets.megatron_t5_dataset import (
    MegatronT5Dataset,
    ngram_length_probabilities,
    ngram_noise_mask,
)
from megatron.data.datasets.span_corruption import uncorrupt
from megatron.data.datasets.t5_dataset import IGNORE_INDEX, T5SpecialTokens

PAD, EOS, START = 0, 1, 0
SENTINELS = tuple(range(199, 99, -1))  # <extra_id_0> = 199, as Hugging Face counts down
VOCAB = 1000                           # ordinary tokens are 200..999
TOKENS = T5SpecialTokens(PAD, EOS, START, SENTINELS)
ENC, DEC = 128, 48
N_DOCS = 300


def spans_of(mask):
    """[(begin, end)] of the runs of True in a bool array."""
    edges = np.diff(np.concatenate([[0], np.asarray(mask, dtype=np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A sentence-level dataset: 300 documents of 1..12 sentences of 0..60 random tokens."""
    prefix = str(tmp_path_factory.mktemp("mt5") / "corpus_text_sentence")
    rng = np.random.default_rng(2024)
    with IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16) as b:
        for _ in range(N_DOCS):
            for _ in range(int(rng.integers(1, 13))):
                b.add_item(rng.integers(200, VOCAB, size=int(rng.integers(0, 61))))
            b.end_document()
        b.finalize(prefix + ".idx")
    return IndexedDataset(prefix)


def make(corpus, tmp_path, num_samples=2000, document_range=(0, N_DOCS), **kw):
    args = dict(encoder_seq_length=ENC, decoder_seq_length=DEC, tokens=TOKENS,
                cache_dir=str(tmp_path / "cache"))
    args.update(kw)
    return MegatronT5Dataset("train", corpus, document_range, num_samples, **args)


@pytest.fixture(scope="module")
def dataset(corpus, tmp_path_factory):
    return MegatronT5Dataset("train", corpus, (0, N_DOCS), 2000, ENC, DEC, TOKENS,
                             cache_dir=str(tmp_path_factory.mktemp("cache")))


def unpadded(sample):
    inputs = sample["encoder_input_ids"][sample["encoder_attention_mask"] == 1]
    targets = sample["labels"][sample["labels"] != IGNORE_INDEX]
    return inputs, targets


def test_shapes_dtypes_and_layout(dataset):
    assert len(dataset) == 2000
    for i in range(0, 2000, 7):
        s = dataset[i]
        assert set(s) == {"encoder_input_ids", "decoder_input_ids", "labels",
                          "encoder_attention_mask", "decoder_attention_mask"}
        for key in ("encoder_input_ids", "encoder_attention_mask"):
            assert s[key].shape == (ENC,) and s[key].dtype == np.int64
        for key in ("decoder_input_ids", "labels", "decoder_attention_mask"):
            assert s[key].shape == (DEC,) and s[key].dtype == np.int64
        inputs, targets = unpadded(s)
        n_in, n_tg = len(inputs), len(targets)
        # Padding only at the end; masks agree with the labels.
        assert s["encoder_attention_mask"][:n_in].all()
        assert not s["encoder_attention_mask"][n_in:].any()
        assert (s["encoder_input_ids"][n_in:] == PAD).all()
        assert (s["decoder_attention_mask"] == (s["labels"] != IGNORE_INDEX)).all()
        assert inputs[-1] == EOS and targets[-1] == EOS
        # Decoder input = target shifted right after the start id.
        assert s["decoder_input_ids"][0] == START
        assert (s["decoder_input_ids"][1:n_tg] == targets[:-1]).all()
        # Sentinels in order <extra_id_0>, <extra_id_1>, ... in input and target alike.
        in_sent = [t for t in inputs if 100 <= t < 200]
        tg_sent = [t for t in targets if 100 <= t < 200]
        assert in_sent == tg_sent == list(SENTINELS[:len(in_sent)])
        if len(dataset.raw_tokens(i)):  # every non-empty sample masks something
            assert len(in_sent) >= 1 and targets[0] == SENTINELS[0]


def test_targets_put_back_give_the_raw_tokens(dataset):
    """Inverse: replacing each sentinel by its target span restores the raw tokens exactly."""
    for i in range(2000):
        raw = dataset.raw_tokens(i)
        inputs, targets = unpadded(dataset[i])
        np.testing.assert_array_equal(uncorrupt(inputs, targets, SENTINELS, EOS), raw)
        assert len(raw) <= ENC - 1 and len(inputs) <= len(raw) + 1


def test_masked_fraction(corpus, tmp_path, dataset):
    # Megatron's budget is min(p * target, max(1, round(len * p))) masked tokens (len <= target:
    # samples are truncated to their target length), and the draw shrinks n-grams to meet it
    # exactly unless candidates run out (a handful of tiny samples). So the aggregate fraction is
    # p up to the rounding of each sample (|error| <= 0.5 token on ~90-token samples, mean ~0):
    # 0.01 is several times what rounding and the few short samples can move it.
    for ds, p in ((dataset, 0.15), (make(corpus, tmp_path, masked_lm_prob=0.3,
                                         decoder_seq_length=80), 0.3)):
        masked = total = 0
        exact = 0
        for i in range(len(ds)):
            m = ds.noise_mask(i)
            target = ds.sample_sentences(i)[2]
            budget = max(1, math.floor(min(p * target, max(1, round(len(m) * p)))))
            assert m.sum() <= budget
            exact += int(m.sum() == budget)
            masked += int(m.sum())
            total += len(m)
        assert abs(masked / total - p) < 0.01, masked / total
        assert exact >= 0.95 * len(ds)


@pytest.mark.parametrize("distribution", ["megatron", "spanbert"])
def test_ngram_length_distribution(distribution):
    probs = ngram_length_probabilities(10, distribution)
    assert probs.shape == (10,) and abs(probs.sum() - 1) < 1e-12
    assert (np.diff(probs[:9]) < 0).all()  # geometric: P(n+1) = 0.8 P(n)
    np.testing.assert_allclose(probs[1:9] / probs[:8], 0.8)
    if distribution == "megatron":  # min(Geometric(0.2), 10): the tail lands on 10
        assert probs[0] == pytest.approx(0.2) and probs[9] == pytest.approx(0.8 ** 9)
    else:  # renormalised over 1..10: decreasing throughout, mean 3.80 (the SpanBERT paper)
        assert probs[9] < probs[8]
        assert (np.arange(1, 11) * probs).sum() == pytest.approx(3.797, abs=1e-3)
    # The first span chosen in a sample meets an empty mask and a budget (30) above 10, so its
    # length is the drawn n unless its start is within 10 tokens of the end (excluded). 20000
    # draws: the standard error of each frequency is <= 0.0035; 0.015 is > 4 of them.
    rng = np.random.default_rng(7)
    first = []
    for _ in range(20000):
        _, spans = ngram_noise_mask(200, 200, 0.15, 10, rng, distribution=distribution,
                                    return_spans=True)
        begin, end = spans[0]
        if begin < 190:
            first.append(end - begin)
    freq = np.bincount(first, minlength=11)[1:] / len(first)
    assert len(first) > 18500
    np.testing.assert_allclose(freq, probs, atol=0.015)


@pytest.mark.parametrize("distribution", ["megatron", "spanbert"])
def test_span_lengths_in_samples(corpus, tmp_path, distribution):
    ds = make(corpus, tmp_path, ngram_distribution=distribution)
    lengths = []
    for i in range(len(ds)):
        lengths += [e - b for b, e in spans_of(ds.noise_mask(i))]
    hist = np.bincount(lengths, minlength=11)
    assert len(hist) == 11 and hist[0] == 0  # no span longer than max_ngram = 10
    freq = hist[1:] / hist.sum()
    # The budget shrinks late n-grams and overlapping ones are skipped, so realised spans are
    # shorter than drawn, but they still decrease geometrically over 1..9 (and up to 10 for the
    # renormalised distribution; Megatron's clipped draw keeps some mass on 10).
    assert (np.diff(freq[:9]) < 0).all(), freq
    if distribution == "spanbert":
        assert freq[9] < freq[8], freq
    assert (freq[:9] >= ngram_length_probabilities(10, distribution)[:9] - 0.1).all()
    # Spans never touch (they would merge under one sentinel).
    for i in range(200):
        spans = spans_of(ds.noise_mask(i))
        assert all(b2 > e1 for (_, e1), (b2, _) in zip(spans, spans[1:]))
    # A smaller max_ngram caps spans too.
    short = make(corpus, tmp_path, max_ngram=3, ngram_distribution=distribution)
    assert max(e - b for i in range(300) for b, e in spans_of(short.noise_mask(i))) <= 3


def test_samples_are_whole_sentences_of_one_document(corpus, tmp_path, dataset):
    bounds = np.asarray(corpus.document_indices)
    for ds, (lo, hi) in ((dataset, (0, N_DOCS)),
                         (make(corpus, tmp_path, document_range=(100, 200), num_samples=500),
                          (100, 200))):
        short = 0
        for i in range(len(ds)):
            first, last, target = ds.sample_sentences(i)
            doc = int(np.searchsorted(bounds, first, side="right")) - 1
            assert lo <= doc < hi
            assert bounds[doc] <= first < last <= bounds[doc + 1]
            assert 2 <= target <= ENC - 1
            raw = ds.raw_tokens(i)
            sentences = np.concatenate(corpus[first:last]).astype(np.int64)
            assert len(raw) == min(target, len(sentences))
            np.testing.assert_array_equal(raw, sentences[:len(raw)])
            short += int(target < ENC - 1)
        # short_seq_prob = 0.1 of the targets are shorter than the maximum.
        assert 0.05 < short / len(ds) < 0.15


def test_determinism(corpus, tmp_path, dataset):
    again = make(corpus, tmp_path / "again")  # same seed, mapping rebuilt in another cache
    cached = make(corpus, tmp_path / "again")  # and read back from that cache
    other = make(corpus, tmp_path / "other", seed=99)
    np.testing.assert_array_equal(np.asarray(again.mapping), np.asarray(dataset.mapping))
    np.testing.assert_array_equal(np.asarray(cached.mapping), np.asarray(dataset.mapping))
    differ = 0
    for i in reversed(range(0, 2000, 3)):  # the access order does not matter
        a, b = dataset[i], again[i]
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
        np.testing.assert_array_equal(cached[i]["labels"], a["labels"])
        differ += int(not np.array_equal(other[i]["encoder_input_ids"], a["encoder_input_ids"]))
    assert differ > 0.9 * len(range(0, 2000, 3))
    assert not np.array_equal(np.asarray(other.mapping), np.asarray(dataset.mapping))
    # The mask of sample i comes from a generator seeded with (seed, i), whatever else happened.
    for ds, seed in ((dataset, 1234), (other, 99)):
        for i in (0, 17, 1999):
            raw = ds.raw_tokens(i)
            expected = ngram_noise_mask(len(raw), ds.sample_sentences(i)[2], 0.15, 10,
                                        np.random.default_rng([seed, i]), max_target_length=DEC,
                                        max_spans=len(SENTINELS))
            np.testing.assert_array_equal(ds.noise_mask(i), expected)
    # The masking alone depends on the seed too: same raw tokens, other masks.
    rngs = [np.random.default_rng([s, 5]) for s in (1, 2)]
    masks = [ngram_noise_mask(500, 500, 0.15, 10, r) for r in rngs]
    assert not np.array_equal(*masks)


def test_decoder_length_caps_the_masking(corpus, tmp_path):
    ds = make(corpus, tmp_path, decoder_seq_length=8, num_samples=500)
    for i in range(len(ds)):
        s = ds[i]  # would raise if the target did not fit
        inputs, targets = unpadded(s)
        assert len(targets) <= 8
        np.testing.assert_array_equal(uncorrupt(inputs, targets, SENTINELS, EOS),
                                      ds.raw_tokens(i))
    # Few sentinels cap the number of spans.
    few = T5SpecialTokens(PAD, EOS, START, SENTINELS[:2])
    ds = make(corpus, tmp_path, tokens=few, num_samples=300)
    for i in range(len(ds)):
        assert len(spans_of(ds.noise_mask(i))) <= 2
        ds[i]


def test_whole_word_spans(corpus, tmp_path):
    word_start = np.zeros(VOCAB, dtype=bool)
    word_start[200::3] = True  # a third of the pieces start a word
    tokens = T5SpecialTokens(PAD, EOS, START, SENTINELS, word_start)
    ds = make(corpus, tmp_path, tokens=tokens, num_samples=500, decoder_seq_length=96)
    for i in range(len(ds)):
        raw = ds.raw_tokens(i)
        starts = word_start[raw].copy()
        if len(raw):
            starts[0] = True
        for b, e in spans_of(ds.noise_mask(i)):
            assert starts[b] and (e == len(raw) or starts[e])  # whole words only
        inputs, targets = unpadded(ds[i])
        np.testing.assert_array_equal(uncorrupt(inputs, targets, SENTINELS, EOS), raw)


def test_errors(corpus, tmp_path):
    cases = [
        (dict(encoder_seq_length=2), "--encoder-seq-length"),
        (dict(decoder_seq_length=2), "--decoder-seq-length"),
        (dict(masked_lm_prob=0.0), "--mask-prob"),
        (dict(masked_lm_prob=1.0), "--mask-prob"),
        (dict(short_seq_prob=1.5), "--short-seq-prob"),
        (dict(max_ngram=0), "--max-ngram"),
        (dict(seed=-1), "--seed"),
        (dict(ngram_distribution="poisson"), "distribution"),
        (dict(document_range=(10, N_DOCS + 1)), "document range"),
        (dict(tokens=T5SpecialTokens(PAD, EOS, START, ())), "--vocab-extra-ids"),
        (dict(num_samples=-1), "num_samples"),
        (dict(document_range=(5, 5)), "can make a sample"),
    ]
    for kw, message in cases:
        num_samples = kw.pop("num_samples", 10)
        with pytest.raises(ValueError, match=message):
            make(corpus, tmp_path, num_samples=num_samples, **kw)
    ds = make(corpus, tmp_path, num_samples=10)
    for bad in (-1, 10):
        with pytest.raises(IndexError):
            ds.raw_tokens(bad)
    assert len(make(corpus, tmp_path, num_samples=0)) == 0


def test_documents_with_too_long_sentences_are_skipped(tmp_path):
    prefix = str(tmp_path / "long_text_sentence")
    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16) as b:
        for _ in range(3):
            b.add_item(rng.integers(200, VOCAB, size=600))  # over Megatron's 512
            b.add_item(rng.integers(200, VOCAB, size=10))
            b.end_document()
        b.finalize(prefix + ".idx")
    with pytest.raises(ValueError, match="longer than 512"):
        MegatronT5Dataset("train", IndexedDataset(prefix), (0, 3), 10, ENC, DEC, TOKENS,
                          cache_dir=str(tmp_path / "cache"))
