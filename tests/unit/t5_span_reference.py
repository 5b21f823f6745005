"""The reference for span layouts: a numpy port of the t5 library's `random_spans_noise_mask`
(t5/data/preprocessors.py, read there, written here), and the two-sample test that compares a
mask generator's span lengths, gaps and start positions with it over many seeds.

Used by test_span_corruption.py (megatron/data/datasets/span_corruption.py) and test_ul2.py (UL2's R and X
denoisers). Counts alone (noise tokens, span count) cannot tell t5's uniformly random layout from
spans of equal length at fixed places; these distributions can (`fixed_layout_mask` is that
mutant, and each test asserts that the check rejects it).
"""

import numpy as np
from scipy import stats

ALPHA = 1e-3
"""False-alarm rate of each of the three chi-square tests of `layout_pvalues`: a generator with
t5's distribution fails `assert_t5_layout` with probability at most 3 x ALPHA per call (for a
fresh choice of seeds; the seeds here are fixed, so a test's outcome is too)."""


def t5_counts(length, noise_density, mean_noise_span_length):
    """(length after t5's `max(length, 2)`, noise tokens, noise spans) as t5 computes them:
    round half to even (tf.round, np.round), noise in [1, length - 1], at least one span."""
    length = max(length, 2)
    noise = min(max(int(np.round(length * noise_density)), 1), length - 1)
    return length, noise, max(int(np.round(noise / mean_noise_span_length)), 1)


def t5_random_segmentation(num_items, num_segments, rng):
    """t5's `_random_segmentation`: shuffle num_segments - 1 "a segment starts here" flags over
    the num_items - 1 places after the first item, then count the items of each segment."""
    flags = (np.arange(num_items - 1) < num_segments - 1).astype(np.int64)
    rng.shuffle(flags)  # t5: seqio.stateless_shuffle
    segment_of_item = np.cumsum(np.concatenate([[0], flags]))
    return np.bincount(segment_of_item, minlength=num_segments)  # t5: unsorted_segment_sum


def t5_random_spans_noise_mask(length, noise_density, mean_noise_span_length, rng):
    """t5's `random_spans_noise_mask` (no random roll): non-noise and noise spans alternate,
    starting with non-noise and ending with noise; all layouts with t5's counts equally likely."""
    original = length
    length, noise, spans = t5_counts(length, noise_density, mean_noise_span_length)
    noise_lengths = t5_random_segmentation(noise, spans, rng)
    nonnoise_lengths = t5_random_segmentation(length - noise, spans, rng)
    interleaved = np.stack([nonnoise_lengths, noise_lengths], axis=1).reshape(-1)
    span_starts = np.bincount(np.cumsum(interleaved)[:-1], minlength=length)
    return (np.cumsum(span_starts) % 2 == 1)[:original]


def fixed_layout_mask(length, noise_density, mean_noise_span_length, rng):
    """The mutant: t5's counts, but spans of (nearly) equal length at evenly spaced places, the
    last one ending the window as t5's does; `rng` is not used."""
    length, noise, spans = t5_counts(length, noise_density, mean_noise_span_length)
    noise_lengths = np.full(spans, noise // spans) + (np.arange(spans) < noise % spans)
    gaps = np.full(spans, (length - noise) // spans) + (np.arange(spans) < (length - noise) % spans)
    mask = np.zeros(length, dtype=bool)
    position = 0
    for gap, span in zip(gaps, noise_lengths):
        mask[position + gap:position + gap + span] = True
        position += gap + span
    return mask


def noise_spans(mask):
    """(starts, lengths, gaps) of the noise spans of `mask`; a gap is the run of non-noise
    tokens before its span."""
    edges = np.diff(np.concatenate([[0], np.asarray(mask, dtype=np.int8), [0]]))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    previous_ends = np.concatenate([[0], ends[:-1]])
    return starts, ends - starts, starts - previous_ends


def one_span_per_mask(masks):
    """(start, length, gap) of the (i mod k)-th noise span of the i-th mask of k spans: one
    observation per mask, so that the observations are independent (the spans of one mask are
    not: their lengths add up to the noise), and every span place is looked at."""
    out = []
    for i, mask in enumerate(masks):
        starts, lengths, gaps = noise_spans(mask)
        j = i % len(starts)
        out.append((starts[j], lengths[j], gaps[j]))
    return np.asarray(out, dtype=np.int64).T


def two_sample_pvalue(a, b, max_bins=20):
    """p-value of Pearson's chi-square test that the integers `a` and `b` come from the same
    distribution: bins at the pooled quantiles (at most `max_bins`, merged until each holds 10
    pooled observations). Both constant and equal: 1; a single bin otherwise cannot happen."""
    pooled = np.concatenate([a, b])
    if pooled.min() == pooled.max():
        return 1.0
    edges = np.unique(np.quantile(pooled, np.linspace(0, 1, max_bins + 1), method="lower"))
    edges = np.concatenate([edges[:-1], [pooled.max() + 1]])
    table = np.stack([np.histogram(a, edges)[0], np.histogram(b, edges)[0]])
    merged = [table[:, 0]]
    for column in table.T[1:]:
        if merged[-1].sum() < 10:
            merged[-1] = merged[-1] + column
        else:
            merged.append(column)
    if len(merged) > 1 and merged[-1].sum() < 10:
        merged[-2] = merged[-2] + merged.pop()
    table = np.stack(merged, axis=1)
    if table.shape[1] == 1:
        return 1.0 if set(np.unique(a)) == set(np.unique(b)) else 0.0
    return float(stats.chi2_contingency(table, correction=False).pvalue)


def layout_pvalues(masks, length, noise_density, mean_noise_span_length, seed=12345):
    """{"start", "length", "gap"}: p-values of `masks` (one per seed) against as many masks of
    `t5_random_spans_noise_mask` drawn from seeds of their own."""
    reference = [t5_random_spans_noise_mask(length, noise_density, mean_noise_span_length,
                                            np.random.default_rng([seed, i]))
                 for i in range(len(masks))]
    ours, theirs = one_span_per_mask(masks), one_span_per_mask(reference)
    return {name: two_sample_pvalue(ours[k], theirs[k])
            for k, name in enumerate(("start", "length", "gap"))}


def assert_t5_layout(masks, length, noise_density, mean_noise_span_length):
    """`masks` have t5's distribution of span starts, lengths and gaps (each test at ALPHA)."""
    p = layout_pvalues(masks, length, noise_density, mean_noise_span_length)
    assert min(p.values()) >= ALPHA, (length, noise_density, mean_noise_span_length, p)


def rejects(masks, length, noise_density, mean_noise_span_length):
    """Whether `assert_t5_layout` fails on `masks`."""
    p = layout_pvalues(masks, length, noise_density, mean_noise_span_length)
    return min(p.values()) < ALPHA
