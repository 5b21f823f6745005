"""Span corruption against T5's definitions, and the samplers and split rules against Megatron's."""

import numpy as np
import pytest

from megatron.data.datasets.builder import parse_split, split_sample_counts
from megatron.data.datasets.samplers import PretrainingSampler
from megatron.data.datasets.span_corruption import (
    corrupt,
    expected_lengths,
    random_spans_noise_mask,
    uncorrupt,
    whole_word_noise_mask,
)

from t5_span_reference import (
    assert_t5_layout,
    fixed_layout_mask,
    rejects,
    t5_random_spans_noise_mask,
)

SENTINELS = np.arange(32199, 32099, -1)  # <extra_id_0> is the highest id, as in HF's T5
EOS = 1


def test_expected_lengths_match_t5():
    # T5's random_spans_helper: 512 encoder tokens take 568 raw tokens and give 114 targets.
    assert expected_lengths(512, 0.15, 3.0) == (568, 114)
    for enc in (64, 128, 256, 512, 1024):
        raw, target = expected_lengths(enc)
        noise = round(raw * 0.15)
        spans = round(noise / 3.0)
        assert raw - noise + spans + 1 == enc  # the input fills the encoder exactly
        assert noise + spans + 1 == target
    with pytest.raises(ValueError):
        expected_lengths(512, 1.5)


def test_hand_example():
    tokens = np.array([10, 11, 12, 13, 14, 15, 16, 17])
    mask = np.array([0, 0, 1, 1, 0, 0, 0, 1], dtype=bool)
    inputs, targets = corrupt(tokens, mask, SENTINELS, EOS)
    assert inputs.tolist() == [10, 11, 32199, 14, 15, 16, 32198, EOS]
    assert targets.tolist() == [32199, 12, 13, 32198, 17, EOS]


def test_statistics_and_inverse():
    rng = np.random.default_rng(0)
    raw, target = expected_lengths(512)
    fractions, span_lengths, masks = [], [], []
    for _ in range(3000):
        tokens = rng.integers(3, 32000, size=raw)
        mask = random_spans_noise_mask(raw, 0.15, 3.0, rng)
        masks.append(mask)
        assert not mask[0]  # spans start with non-noise, as T5's do
        inputs, targets = corrupt(tokens, mask, SENTINELS, EOS)
        assert len(inputs) == 512 and len(targets) == target
        used = [t for t in inputs.tolist() if t in set(SENTINELS.tolist())]
        assert used == SENTINELS[:len(used)].tolist()  # <extra_id_0>, <extra_id_1>, ...
        assert [t for t in targets.tolist() if t in set(used)] == used  # once each, in order
        np.testing.assert_array_equal(uncorrupt(inputs, targets, SENTINELS, EOS), tokens)
        starts = mask & ~np.concatenate([[False], mask[:-1]])
        fractions.append(mask.mean())
        span_lengths.append(mask.sum() / starts.sum())
    assert abs(np.mean(fractions) - 0.15) < 0.01
    assert abs(np.mean(span_lengths) - 3.0) < 0.3
    # where the spans are and how long: t5's distribution, which a fixed layout has not
    assert_t5_layout(masks, raw, 0.15, 3.0)
    assert rejects([fixed_layout_mask(raw, 0.15, 3.0, None)] * len(masks), raw, 0.15, 3.0)


@pytest.mark.parametrize("length,density,mean_span", [(100, 0.3, 5.0), (511, 0.5, 8.0),
                                                      (57, 0.15, 3.0)])
def test_span_layout_is_t5s(length, density, mean_span):
    """Span starts, lengths and gaps against the numpy port of t5's random_spans_noise_mask
    over 2000 seeds (chi-square, tests/unit/t5_span_reference.py); the fixed layout fails."""
    masks = [random_spans_noise_mask(length, density, mean_span, np.random.default_rng(seed))
             for seed in range(2000)]
    reference = t5_random_spans_noise_mask(length, density, mean_span, np.random.default_rng(0))
    assert all(m.sum() == reference.sum() for m in masks)  # t5's counts
    assert_t5_layout(masks, length, density, mean_span)
    mutant = [fixed_layout_mask(length, density, mean_span, None)] * len(masks)
    assert all(m.sum() == reference.sum() for m in mutant)  # the same counts ...
    assert rejects(mutant, length, density, mean_span)  # ... but not t5's layout


def test_whole_word_mask_never_splits_words():
    rng = np.random.default_rng(1)
    for _ in range(200):
        starts = rng.random(300) < 0.6
        mask = whole_word_noise_mask(starts, 0.15, 3.0, rng)
        starts[0] = True
        word = np.cumsum(starts)
        for w in np.unique(word):
            assert len(set(mask[word == w].tolist())) == 1  # a word is all noise or none


def test_parse_split_megatron_rounding():
    assert parse_split("950,30,20", 1000) == [(0, 950), (950, 980), (980, 1000)]
    assert parse_split("98/2", 333) == [(0, 326), (326, 333), (333, 333)]
    assert parse_split("1", 10) == [(0, 10), (10, 10), (10, 10)]
    # Rounding never loses or invents a document: the last bound is the document count.
    for n in (1, 7, 101, 12345):
        assert parse_split("969,30,1", n)[-1][1] == n
    for bad in ("", "a,b", "-1,2", "0,0,0", "1,2,3,4"):
        with pytest.raises(ValueError, match="--split"):
            parse_split(bad, 10)


def test_sample_counts():
    assert split_sample_counts(1000, 8, 100, 5) == (8000, 11 * 5 * 8, 40)


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_sampler_shards_union_is_the_global_batch(dp):
    total, micro = 103, 3
    shards = [list(PretrainingSampler(total, 0, micro, r, dp)) for r in range(dp)]
    single = list(PretrainingSampler(total, 0, micro * dp, 0, 1))
    assert len({len(s) for s in shards}) == 1 and len(shards[0]) == len(single)
    for step, global_batch in enumerate(single):
        assert sorted(sum((s[step] for s in shards), [])) == global_batch


def test_sampler_resume():
    full = list(PretrainingSampler(100, 0, 2, 1, 2))
    resumed = list(PretrainingSampler(100, 3 * 4, 2, 1, 2))
    assert resumed == full[3:]
    with pytest.raises(ValueError, match="multiple"):
        PretrainingSampler(100, 5, 2, 0, 2)
    evaluation = list(PretrainingSampler(10, 0, 4, 1, 2, drop_last=False))
    assert evaluation == [[4, 5, 6, 7]]
    for rank in range(2):
        sampler = PretrainingSampler(10, 0, 4, rank, 2, drop_last=False)
        assert len(sampler) == len(list(sampler))
