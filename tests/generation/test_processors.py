"""The logits processors (megatron/generation/processors.py) each against a hand computation
and against transformers' processor of the same name; the decoding settings' list of them and
their problems (megatron/generation/settings.py); the forced EOS through greedy and beam search
against transformers' `generate`."""

import dataclasses
import math

import pytest
import torch
from generation_models import EOS, PAD, hf_of, hf_rows, our_model, padded_batch
from transformers.generation import logits_process as hf_process

from megatron.generation import (Decoder, DecodingSettings, SpecialTokens, beam_search, greedy,
                                 sample)
from megatron.generation.processors import (ForcedEOS, NoRepeatNGram, Temperature, TopK, TopP,
                                            apply)

INF = float("inf")
TOKENS = SpecialTokens(start=PAD, eos=EOS, pad=PAD)


def test_no_repeat_ngram_bans_what_would_repeat_a_bigram_or_trigram():
    def banned(n, row):
        scores = NoRepeatNGram(n)(torch.tensor([row]), torch.zeros(1, 8))
        return scores[0].isinf().nonzero().flatten().tolist()

    assert banned(2, [0, 3, 4, 5, 3]) == [4]  # bigrams (3,4) (4,5) (5,3); ends in 3
    assert banned(3, [1, 2, 1, 2, 7, 1, 2]) == [1, 7]  # trigrams (1,2,1) (1,2,7); ends in 1,2
    assert banned(4, [1, 2, 1]) == []  # shorter than n


def test_forced_eos_only_at_the_last_position():
    scores = torch.tensor([[0.5, -1.0, 2.0], [1.0, 1.0, 1.0]])
    force = ForcedEOS(max_length=4, eos_id=1)
    assert torch.equal(force(torch.zeros(2, 2, dtype=torch.long), scores), scores)
    assert force(torch.zeros(2, 3, dtype=torch.long), scores).tolist() == [[-INF, 0.0, -INF]] * 2


def test_temperature_divides():
    scores = torch.tensor([[1.0, -2.0, 0.5]])
    assert Temperature(0.5)(None, scores).tolist() == [[2.0, -4.0, 1.0]]


def test_top_k_keeps_the_k_best_and_their_ties():
    scores = torch.tensor([[0.25, 0.75, 0.5, 0.5, -1.0]])
    assert TopK(2)(None, scores).tolist() == [[-INF, 0.75, 0.5, 0.5, -INF]]
    assert TopK(10)(None, scores).tolist() == scores.tolist()  # more than the vocabulary


def test_top_p_keeps_the_smallest_set_reaching_p():
    # probabilities 0.5, 0.3, 0.15, 0.05 (logs of them as scores)
    probs = [0.5, 0.3, 0.15, 0.05]
    scores = torch.tensor([[math.log(p) for p in probs]])
    kept = lambda p: TopP(p)(None, scores).isfinite()[0].tolist()  # noqa: E731
    assert kept(0.5) == [True, False, False, False]
    assert kept(0.7) == [True, True, False, False]  # 0.5 < 0.7 <= 0.8
    assert kept(0.9) == [True, True, True, False]
    assert kept(0.01) == [True, False, False, False]  # at least the best one


@pytest.mark.parametrize("ours, theirs", [
    (NoRepeatNGram(2), hf_process.NoRepeatNGramLogitsProcessor(2)),
    (NoRepeatNGram(3), hf_process.NoRepeatNGramLogitsProcessor(3)),
    (ForcedEOS(7, EOS), hf_process.ForcedEOSTokenLogitsProcessor(7, EOS)),
    (ForcedEOS(6, EOS), hf_process.ForcedEOSTokenLogitsProcessor(6, EOS)),
    (Temperature(0.7), hf_process.TemperatureLogitsWarper(0.7)),
    (TopK(5), hf_process.TopKLogitsWarper(5)),
    (TopP(0.8), hf_process.TopPLogitsWarper(0.8)),
])
def test_each_processor_gives_transformers_scores(ours, theirs):
    g = torch.Generator().manual_seed(3)
    sequences = torch.randint(0, 4, (5, 6), generator=g)  # few ids: repeated n-grams
    scores = torch.randn(5, 40, generator=g) * 3
    assert torch.equal(ours(sequences, scores), theirs(sequences, scores.clone()))


def test_settings_list_transformers_processors_in_its_order():
    settings = DecodingSettings(max_new_tokens=9, no_repeat_ngram_size=2, forced_eos=True,
                                do_sample=True, temperature=0.5, top_k=4, top_p=0.9)
    found = settings.processors(EOS)
    assert [type(p) for p in found] == [NoRepeatNGram, ForcedEOS, Temperature, TopK, TopP]
    assert found[1].max_length == 10  # the decoder start counts
    # the warpers only when sampling; the defaults: none at all
    assert [type(p) for p in DecodingSettings(top_k=4, temperature=0.5).processors(EOS)] == []
    g = torch.Generator().manual_seed(1)
    sequences, scores = torch.randint(0, 4, (3, 9), generator=g), torch.randn(3, 20, generator=g)
    want = scores.clone()
    for p in (hf_process.NoRepeatNGramLogitsProcessor(2),
              hf_process.ForcedEOSTokenLogitsProcessor(10, EOS),
              hf_process.TemperatureLogitsWarper(0.5), hf_process.TopKLogitsWarper(4),
              hf_process.TopPLogitsWarper(0.9)):
        want = p(sequences, want)
    assert torch.equal(apply(found, sequences, scores), want)


def test_settings_problems_name_the_flags():
    bad = DecodingSettings(max_new_tokens=0, num_beams=2, no_repeat_ngram_size=-1,
                           do_sample=True, temperature=0.0, top_k=-1, top_p=1.5)
    assert bad.problems() == [
        "--max-new-tokens must be at least 1, not 0",
        "--no-repeat-ngram-size must be 0 (off) or more",
        "--do-sample with --num-beams > 1 (beam sampling) is not supported: choose one",
        "--temperature must be positive, not 0.0",
        "--top-k must be 0 (off) or more, not -1",
        "--top-p must be in (0, 1], not 1.5",
    ]
    assert DecodingSettings().problems() == []
    with pytest.raises(dataclasses.FrozenInstanceError):
        DecodingSettings().seed = 3


def test_settings_from_the_command_line_values():
    values = dict(max_new_tokens=5, num_beams=2, early_stopping="never", seed=9, load="x")
    settings = DecodingSettings.from_flags(values)
    assert (settings.max_new_tokens, settings.num_beams, settings.early_stopping,
            settings.seed) == (5, 2, "never", 9)
    assert settings.reseeded(4).seed == 13 and settings.seed == 9


@pytest.mark.parametrize("beams", [1, 3])
def test_forced_eos_in_greedy_and_beam_search_equals_transformers(beams):
    model = our_model("v1_0")
    hf = hf_of(model, "v1_0")
    ids, mask = padded_batch()
    settings = DecodingSettings(max_new_tokens=5, num_beams=beams, forced_eos=True)
    search = greedy if beams == 1 else beam_search
    ours = search(Decoder(model, ids, mask, expand=beams), ids.shape[0], TOKENS, settings)
    with torch.no_grad():
        ref = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                          num_beams=beams, forced_eos_token_id=EOS, use_cache=False)
    assert [h.ids for h in ours] == hf_rows(ref)
    assert all(h.ids[-1] == EOS for h in ours)


def test_sampling_applies_forced_eos_and_the_n_gram_ban():
    model = our_model("v1_1")
    ids, mask = padded_batch()
    settings = DecodingSettings(max_new_tokens=6, do_sample=True, top_k=3, seed=2,
                                no_repeat_ngram_size=2, forced_eos=True)
    for h in sample(Decoder(model, ids, mask), ids.shape[0], TOKENS, settings):
        assert h.ids[-1] == EOS
        row = [PAD] + h.ids
        bigrams = list(zip(row, row[1:]))
        assert len(bigrams) == len(set(bigrams))
