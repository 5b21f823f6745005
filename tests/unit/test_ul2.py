"""UL2's mixture of denoisers (megatron/data/datasets/ul2.py) against numpy ports of the t5 library's
masking functions (t5/data/preprocessors.py: random_spans_noise_mask's counts,
random_prefix_noise_mask, noise_span_to_unique_sentinel, nonnoise_span_to_unique_sentinel),
statistics over 10^5 samples of the shared corpora, exact reconstruction of every sample (English
and Chinese, SentencePiece and CPM-2's tokenizer, mode tokens on and off), lengths and refusals."""

from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from megatron.data.datasets.builder import DataConfig, build_datasets
from megatron.data.datasets.span_corruption import corrupt, uncorrupt
from megatron.data.datasets.t5_dataset import IGNORE_INDEX, T5DatasetConfig, T5SpecialTokens
from megatron.data.tokenizers.tokenizer import TokenizerSpec, build_tokenizer
from megatron.data.datasets.ul2 import KINDS, PRESETS, Denoiser, UL2Config, denoise, mode_token_ids, \
    parse_denoisers

from t5_span_reference import assert_t5_layout, fixed_layout_mask, noise_spans, rejects

CPM2_VOCAB = Path(__file__).resolve().parents[1] / "data" / "cpm2" / "bpe_cn" / "vocab.txt"
SENTINELS = np.arange(1000, 1100)
EOS = 1


# The t5 library's functions, ported to numpy (the references) ---------------------------------
def t5_noise_counts(length, noise_density, mean_noise_span_length):
    """random_spans_noise_mask's counts: round(length x density) noise tokens (at least 1, at
    most length - 1) in round(noise / mean span) spans (at least 1)."""
    num_noise = min(max(int(np.round(length * noise_density)), 1), length - 1)
    return num_noise, max(int(np.round(num_noise / mean_noise_span_length)), 1)


def t5_noise_span_to_unique_sentinel(tokens, mask, sentinels):
    """Each noise span replaced by the next sentinel (t5: vocab - 1 counting down; ours: the
    tokenizer's <extra_id_i> in order)."""
    prev = np.concatenate([[False], mask[:-1]])
    first = mask & ~prev
    sentinel_of = sentinels[np.cumsum(first) - 1]
    out = np.where(first, sentinel_of, tokens)
    return out[~(mask & prev)]


def t5_nonnoise_span_to_unique_sentinel(tokens, mask, sentinels):
    return t5_noise_span_to_unique_sentinel(tokens, ~mask, sentinels)


def t5_random_prefix_length(length, rng):
    """random_prefix_noise_mask: the input (noise) prefix is uniform over [1, length - 1]."""
    return int(rng.integers(1, length))


# ---------------------------------------------------------------------------------------------
def mask_of_sample(inputs, targets, sentinels=SENTINELS):
    """The noise mask an R or X sample was made with, from its input and target (both ending
    in EOS, no mode token): the runs between the input's sentinels are the kept spans, those
    after each of the target's sentinels the noise spans."""
    in_input = np.flatnonzero(np.isin(inputs[:-1], sentinels))
    in_target = np.flatnonzero(np.isin(targets[:-1], sentinels))
    kept = np.diff(np.concatenate([[-1], in_input])) - 1
    noise = np.diff(np.concatenate([in_target, [len(targets) - 1]])) - 1
    runs = np.stack([kept, noise], axis=1).reshape(-1)
    mask = np.repeat(np.tile([False, True], len(kept)), runs)
    return np.concatenate([mask, np.zeros(len(inputs) - 2 - in_input[-1], dtype=bool)])


@pytest.mark.parametrize("d", [d for d in PRESETS["ul2"] if d.kind != "S"],
                         ids=lambda d: d.describe())
def test_r_and_x_follow_random_spans_noise_mask_and_unique_sentinels(d):
    single = UL2Config((d,))
    masks = []
    for seed in range(2000):
        raw = np.random.default_rng(seed).integers(2, 900, size=511)
        _, inputs, targets = denoise(raw, single, SENTINELS, EOS, np.random.default_rng(seed))
        mask = mask_of_sample(inputs, targets)
        masks.append(mask)
        if seed >= 30:
            continue  # the sample's exact contents on 30 seeds, the layout's law on all
        assert np.array_equal(uncorrupt(inputs, targets, SENTINELS, EOS), raw)
        noise, spans = t5_noise_counts(len(raw), d.rate, d.mean_span)
        k = len(noise_spans(mask)[0])
        assert mask.sum() == noise and k == min(spans, noise, len(raw) - noise)
        assert not mask[0]  # spans alternate, starting with non-noise
        assert np.array_equal(inputs[:-1], t5_noise_span_to_unique_sentinel(raw, mask, SENTINELS))
        assert np.array_equal(targets[:-1],
                              t5_nonnoise_span_to_unique_sentinel(raw, mask, SENTINELS))
    # where the spans fall and how long they are: t5's law (chi-square against the port of
    # random_spans_noise_mask over 2000 seeds), which spans at fixed places would fail
    assert_t5_layout(masks, 511, d.rate, d.mean_span)
    raw = np.arange(2, 513)
    fixed = mask_of_sample(*corrupt(raw, fixed_layout_mask(511, d.rate, d.mean_span, None),
                                    SENTINELS, EOS))
    if len(noise_spans(fixed)[0]) > 1:  # one span: t5's layout is fixed too (noise at the end)
        assert rejects([fixed] * len(masks), 511, d.rate, d.mean_span)


def test_s_is_the_t5_prefix_lm():
    config = UL2Config((Denoiser("S"),))
    for seed in range(50):
        raw = np.random.default_rng(seed).integers(2, 900, size=100)
        rng = np.random.default_rng(seed)
        _, inputs, targets = denoise(raw, config, SENTINELS, EOS, rng)
        reference = np.random.default_rng(seed)
        reference.random()  # the denoiser draw comes first
        prefix = t5_random_prefix_length(len(raw), reference)
        assert inputs.tolist() == raw[:prefix].tolist() + [EOS]
        assert targets.tolist() == raw[prefix:].tolist() + [EOS]


@pytest.fixture(scope="module")
def sample_sets(train_data, tmp_path_factory):
    """10^5 samples of the default mixture over the shared corpora (English and Chinese), 512
    encoder tokens, mode tokens off (their lengths differ by tokenizer)."""
    tokenizer = build_tokenizer(TokenizerSpec("SentencePieceTokenizer", train_data.spm))
    tokens = T5SpecialTokens.from_tokenizer(tokenizer)
    ul2 = UL2Config(PRESETS["ul2"])
    config = DataConfig([train_data.prefix], split="100,0,0",
                        data_cache_path=str(tmp_path_factory.mktemp("ul2cache")),
                        t5=T5DatasetConfig(encoder_seq_length=512, seed=3, ul2=ul2),
                        objective="ul2")
    dataset = build_datasets(config, tokens, (100_000, 0, 0))["train"]
    return dataset, tokens


def test_statistics_of_ten_to_the_five_samples(sample_sets):
    dataset, tokens = sample_sets
    config = dataset.config.ul2
    counts = np.zeros(len(config.denoisers))
    rates = [[] for _ in config.denoisers]
    spans = [[] for _ in config.denoisers]
    masks = [[] for _ in config.denoisers]
    prefixes = []
    sentinels = set(tokens.sentinel_ids)
    for index in range(100_000):
        which, inputs, targets = dataset.denoised(index)
        counts[which] += 1
        d = config.denoisers[which]
        if d.kind == "S":
            prefixes.append(len(inputs) - 1)
            continue
        k = sum(1 for t in targets[:-1].tolist() if t in sentinels)
        noise = len(targets) - 1 - k
        rates[which].append(noise / dataset.raw_length)
        spans[which].append(noise / k)
        if len(masks[which]) < 4000:
            masks[which].append(mask_of_sample(inputs, targets, tokens.sentinel_ids))
    expected = config.weights * counts.sum()
    assert stats.chisquare(counts, expected).pvalue > 0.001
    for which, d in enumerate(config.denoisers):
        if d.kind == "S":
            continue
        noise, k = t5_noise_counts(dataset.raw_length, d.rate, d.mean_span)
        # every sample has the t5 library's counts ...
        assert set(rates[which]) == {noise / dataset.raw_length}
        assert np.mean(spans[which]) == pytest.approx(noise / k)
        # ... so the rate is within 2% of the setting, and the mean span off it by no more
        # than the rounding of the span count: t5's semantics fix round(noise / mean span)
        # spans, so R (8, 0.15) has 10 spans of 7.7 tokens in a 511-token window and X (64,
        # 0.15) one span of 77 tokens
        assert np.mean(rates[which]) == pytest.approx(d.rate, rel=0.02)
        rounding = abs(k - noise / d.mean_span) / k
        assert abs(np.mean(spans[which]) / d.mean_span - 1) <= rounding + 1e-9
        if rounding <= 0.02:
            assert np.mean(spans[which]) == pytest.approx(d.mean_span, rel=0.02)
        # and the spans' starts, lengths and gaps follow t5's law, not only its counts
        assert len(masks[which]) == 4000
        assert_t5_layout(masks[which], dataset.raw_length, d.rate, d.mean_span)
    # S: the prefix uniform over [1, L - 1] (Kolmogorov-Smirnov on the continuous version)
    length = dataset.raw_length
    u = (np.asarray(prefixes) - 1 + np.random.default_rng(0).random(len(prefixes))) / (length - 1)
    assert stats.kstest(u, "uniform").pvalue > 0.001


@pytest.mark.parametrize("mode", [True, False])
@pytest.mark.parametrize("tokenizer_kind", ["sentencepiece", "cpm2"])
def test_every_sample_reconstructs_its_raw_tokens(train_data, tmp_path, mode, tokenizer_kind):
    if tokenizer_kind == "cpm2":
        pytest.importorskip("jieba")
        spec = TokenizerSpec("CPM2Tokenizer", str(CPM2_VOCAB))
    else:
        spec = TokenizerSpec("SentencePieceTokenizer", train_data.spm)
    tokenizer = build_tokenizer(spec)
    tokens = T5SpecialTokens.from_tokenizer(tokenizer)
    modes = mode_token_ids(tokenizer, {"R": "[NLU]", "S": "[S2S]", "X": "[NLG]"}) if mode \
        else None
    ul2 = UL2Config(PRESETS["ul2"], modes)
    config = DataConfig([train_data.prefix], split="100,0,0", data_cache_path=str(tmp_path),
                        t5=T5DatasetConfig(encoder_seq_length=128, seed=5, ul2=ul2),
                        objective="ul2")
    dataset = build_datasets(config, tokens, (700, 0, 0))["train"]
    kinds = {assert_reconstructs(dataset, index, ul2, tokens) for index in range(700)}
    assert kinds == {"R", "S", "X"}


def assert_reconstructs(dataset, index, ul2, tokens):
    """Sample `index` of a UL2 dataset gives back its raw tokens from its input (after the mode
    token) and target, fits the lengths uncut and carries its kind; returns the kind."""
    which, inputs, targets = dataset.denoised(index)
    d = ul2.denoisers[which]
    raw = dataset.raw_tokens(index)
    mode_ids = list(ul2.mode(d.kind))
    assert inputs[:len(mode_ids)].tolist() == mode_ids
    body = inputs[len(mode_ids):]
    if d.kind == "S":
        restored = np.concatenate([body[:-1], targets[:-1]])
    else:
        restored = uncorrupt(body, targets, np.asarray(tokens.sentinel_ids), tokens.eos_id)
    assert np.array_equal(restored, raw), index
    sample = dataset[index]  # fits the budget, nothing cut
    assert sample["encoder_attention_mask"].sum() == len(inputs)
    assert (sample["labels"] != IGNORE_INDEX).sum() == len(targets)
    assert sample["denoiser_kind"].shape == () and \
        ("R", "S", "X")[int(sample["denoiser_kind"])] == d.kind
    return d.kind


def test_kind_sums_add_each_samples_token_losses_and_tokens_to_its_kind():
    import torch

    from megatron.training.metrics import format_line
    from megatron.training.denoiser_metrics import kind_sums, metrics, step_losses, summary_fields

    labels = torch.tensor([[5, 6, -100], [7, -100, -100], [1, 2, 3], [4, 4, -100]])
    losses = torch.tensor([[1.0, 2.0, 0.0], [4.0, 0.0, 0.0], [0.5, 0.5, 0.5], [3.0, 1.0, 0.0]])
    got = kind_sums(losses, labels, torch.tensor([2, 0, 2, 2]))
    # by hand: R = sample 1 (4.0 over 1 token), S none, X = samples 0, 2, 3 (3 + 1.5 + 4 over 7)
    assert got.tolist() == [[4.0, 1.0], [0.0, 0.0], [8.5, 7.0]]
    assert got.dtype == torch.float64
    # by name: what the loop reduces and logs
    values = {name: m.value for name, m in metrics(got).items()}
    assert {name: float(v) for name, v in values.items()} == {
        "ul2/R/loss_sum": 4.0, "ul2/R/tokens": 1.0, "ul2/S/loss_sum": 0.0, "ul2/S/tokens": 0.0,
        "ul2/X/loss_sum": 8.5, "ul2/X/tokens": 7.0}
    assert step_losses(values) == {"R": (4.0, 1), "X": (8.5 / 7, 7)}
    assert summary_fields(values) == {"loss_R": 4.0, "loss_X": 8.5 / 7}
    line = format_line({"iteration": 3, "data_wait_s": 0.0, "step_time_s": 1.0,
                        "loss_R": 4.0, "loss_X": 8.5 / 7}, None)
    assert line.endswith("| loss R: 4.0000E+00 | loss X: 1.2143E+00") and "loss S" not in line


def test_lengths_fit_every_denoiser_and_a_short_decoder_is_refused():
    config = UL2Config(PRESETS["ul2"], (("R", (5,)), ("S", (6,)), ("X", (7,))))
    raw, enc, dec = config.budget(512)
    assert (raw, enc, dec) == (511, 512, 511)  # S: a 510-token prefix + EOS + [S2S]
    with pytest.raises(ValueError, match=r"--decoder-seq-length 256 is too short for the UL2 "
                                         r"denoiser S"):
        config.budget(512, 256)
    no_s = UL2Config(PRESETS["ul2"][:2] + PRESETS["ul2"][3:])
    assert no_s.budget(512)[2] < 512  # without S the decoder needs X (span 3, 50%)'s targets
    # R (3, 0.15) alone packs what T5's span corruption packs: 568 raw tokens, 114 targets
    r_only = UL2Config((Denoiser("R", 3.0, 0.15),))
    assert r_only.budget(512) == (568, 512, 114)
    # a denoiser that is never drawn sets no length
    assert UL2Config((Denoiser("R", 3.0, 0.15), Denoiser("S", weight=0.0))).budget(512) == \
        (568, 512, 114)


def test_span_corruption_flags_are_refused_with_ul2(train_data):
    from megatron.arguments import ArgumentsError, parse_args
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
    from train_workers import base_argv

    with pytest.raises(ArgumentsError, match="--noise-density has no effect with "
                                             "--t5-objective ul2"):
        parse_args(base_argv(train_data, "--t5-objective", "ul2", "--noise-density", "0.3"))


@pytest.mark.parametrize("spec,message", [
    ('[{"kind": "R", "mean_span": 3, "rate": 0.15, "weight": 0}]', "positive sum"),
    ('[{"kind": "X", "mean_span": 3, "rate": 1.5}]', "rate 1.5 must be in (0, 1)"),
    ('[{"kind": "X", "mean_span": 600, "rate": 0.5}]', "a 1020-token window "
     "(--encoder-seq-length 512) has 510 noise tokens, fewer than one span of 600"),
    ('[{"kind": "Q"}]', "entry 0 must be"),
    ("nonsense", "not a preset"),
])
def test_bad_settings_are_refused_naming_the_flag(spec, message):
    with pytest.raises(ValueError, match="--ul2-denoisers") as e:
        problems = UL2Config(parse_denoisers(spec)).problems(512, 100)
        if problems:
            raise ValueError("; ".join(problems))
    assert message in str(e.value)


def test_one_rule_for_every_mean_span():
    """A denoiser is taken when its window's noise holds one span of its mean length: then its
    spans average the setting up to t5's rounding; else refused, naming the flags."""
    five_pieces = tuple((kind, tuple(range(10 + 5 * i, 15 + 5 * i))) for i, kind in
                        enumerate(KINDS))  # [NLU] etc. in a tokenizer without them
    # the two cases: X (64, 0.15) at encoder 64 (9 noise tokens of a 59-token window)
    # and X (32, 0.5) alone at encoder 16, both refused by the same rule
    paper = UL2Config(PRESETS["ul2"], five_pieces)
    problems = paper.problems(64, 100)
    assert problems[0] == ("--ul2-denoisers: X (span 64, rate 0.15): a 59-token window "
                           "(--encoder-seq-length 64) has 9 noise tokens, fewer than one span "
                           "of 64; it needs round(window x rate) >= mean span: "
                           "--encoder-seq-length 429 or more, or a shorter mean span")
    assert len(problems) == 2 and "X (span 64, rate 0.5): a 59-token window" in problems[1]
    assert UL2Config((Denoiser("X", 32.0, 0.5),)).problems(16, 100)[0].startswith(
        "--ul2-denoisers: X (span 32, rate 0.5): a 28-token window (--encoder-seq-length 16) "
        "has 14 noise tokens, fewer than one span of 32")
    assert paper.problems(429, 100) == [] and paper.problems(428, 100) != []
    # the rule, over many settings: taken exactly when round(window x rate) >= mean span, and
    # a taken denoiser's spans average 0.75 to 1.5 times its mean span
    for enc in (16, 24, 64, 100, 128, 256, 512):
        for span in (1.0, 3.0, 8.0, 12.0, 32.0, 64.0, 100.0):
            for rate in (0.15, 0.25, 0.5):
                config = UL2Config((Denoiser("X", span, rate), Denoiser("S")), five_pieces)
                raw = config.budget(enc)[0]
                noise, k = t5_noise_counts(raw, rate, span)
                assert (config.problems(enc, 1000) == []) == (noise >= span), (enc, span, rate)
                if noise >= span and k <= raw - noise:
                    assert 0.75 <= noise / k / span < 1.5, (enc, span, rate)


def test_the_presets():
    ul2 = PRESETS["ul2"]
    assert [(d.kind, d.mean_span, d.rate) for d in ul2 if d.kind != "S"] == [
        ("R", 3, 0.15), ("R", 8, 0.15), ("X", 3, 0.5), ("X", 8, 0.5), ("X", 64, 0.15),
        ("X", 64, 0.5)]
    assert np.allclose(UL2Config(ul2).weights, 1 / 7)
    upalm = UL2Config(PRESETS["upalm"])
    by_kind = {k: sum(w for d, w in zip(upalm.denoisers, upalm.weights) if d.kind == k)
               for k in "RSX"}
    assert by_kind == pytest.approx({"S": 0.5, "R": 0.25, "X": 0.25})


@pytest.fixture(scope="module")
def sentence_data(spm_model, corpora_dir, tmp_path_factory):
    """English and Chinese text preprocessed with --split-sentences: `_text_sentence` data."""
    import json

    from data_tools import preprocess_data

    out = tmp_path_factory.mktemp("ul2_sentences")
    with open(out / "in.jsonl", "w", encoding="utf-8") as f:
        for name in ("en_shakespeare.jsonl", "zh_cmrc2019_stories.jsonl"):
            with open(corpora_dir / name, encoding="utf-8") as src:
                for i, line in zip(range(60), src):
                    f.write(json.dumps({"text": json.loads(line)["text"][:3000]},
                                       ensure_ascii=False) + "\n")
    assert preprocess_data.main(["--input", str(out / "in.jsonl"), "--output-prefix",
                                 str(out / "mix"), "--tokenizer-model", str(spm_model),
                                 "--split-sentences", "--workers", "1", "--no-progress"]) == 0
    return str(out / "mix_text_sentence")


def test_megatrons_layout_denoises_rows_of_whole_sentences(sentence_data, spm_model, tmp_path):
    from megatron.data.storage.indexed_dataset import IndexedDataset
    from megatron.data.datasets.megatron_t5_dataset import MegatronT5Dataset, MegatronUL2Dataset

    tokenizer = build_tokenizer(TokenizerSpec("SentencePieceTokenizer", str(spm_model)))
    tokens = T5SpecialTokens.from_tokenizer(tokenizer)
    ul2 = UL2Config(PRESETS["ul2"], mode_token_ids(tokenizer, {"R": "[NLU]", "S": "[S2S]",
                                                              "X": "[NLG]"}))
    t5 = T5DatasetConfig(encoder_seq_length=128, seed=3, ul2=ul2)
    config = DataConfig([sentence_data], split="100,0,0", data_cache_path=str(tmp_path),
                        t5=t5, objective="ul2", ul2_layout="megatron", short_seq_prob=0.2)
    dataset = build_datasets(config, tokens, (600, 0, 0))["train"]
    assert isinstance(dataset, MegatronUL2Dataset)
    raw_budget, enc, dec = ul2.budget(128)
    assert (dataset.encoder_length, dataset.decoder_length, dataset.max_raw_length) == \
        (enc, dec, raw_budget)
    # the rows are Megatron's, built with the UL2 budget as the longest row
    rows = MegatronT5Dataset("train", IndexedDataset(sentence_data),
                             dataset.document_range, 600, enc, dec, tokens, short_seq_prob=0.2,
                             seed=3, cache_dir=str(tmp_path / "ref"), max_raw_length=raw_budget)
    indexed = IndexedDataset(sentence_data)
    kinds, lengths = set(), set()
    for index in range(600):
        first, last, target = rows.sample_sentences(index)
        assert dataset.sample_sentences(index) == (first, last, target)
        sentences = np.concatenate([indexed[i] for i in range(first, last)]).astype(np.int64)
        raw = dataset.raw_tokens(index)
        assert np.array_equal(raw, sentences[:min(target, raw_budget)])  # whole sentences, cut
        kinds.add(assert_reconstructs(dataset, index, ul2, tokens))
        lengths.add(len(raw))
    assert kinds == {"R", "S", "X"} and len(lengths) > 10  # rows of many lengths
    again = build_datasets(config, tokens, (600, 0, 0))["train"]  # (seed, index) only
    for index in (0, 17, 599):
        assert all(np.array_equal(again[index][k], v) for k, v in dataset[index].items())
