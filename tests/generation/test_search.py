"""Decoding on one process: the KV-cached decoder against the plain forward at every step, and
greedy and beam search against transformers' `generate` on the same weights (fp32; a v1.0
model, relu and tied, and a v1.1 model, gated-gelu and untied; a padded batch)."""

import pytest
import torch
from generation_models import EOS, PAD, VOCAB, hf_of, hf_rows, our_model, padded_batch

from megatron.generation import (Decoder, DecodingSettings, SpecialTokens, beam_search, greedy,
                                 sample)
from megatron.generation.processors import NoRepeatNGram, apply

TOKENS = SpecialTokens(start=PAD, eos=EOS, pad=PAD)


@pytest.mark.parametrize("name", ["v1_0", "v1_1"])
def test_cached_steps_give_the_full_forward_logits(name):
    """40 steps: the self-attention cache grows past its first 32 positions."""
    model = our_model(name)
    ids, mask = padded_batch()
    decoder = Decoder(model, ids, mask)
    g = torch.Generator().manual_seed(1)
    targets = torch.randint(2, VOCAB, (ids.shape[0], 40), generator=g)
    dec = torch.cat([torch.full((ids.shape[0], 1), PAD), targets], dim=1)
    with torch.no_grad():
        full = model(ids, dec, mask).logits[..., :VOCAB]
    for t in range(dec.shape[1]):
        step = decoder.step(dec[:, t])
        torch.testing.assert_close(step, full[:, t], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ngram", [0, 2])
@pytest.mark.parametrize("name", ["v1_0", "v1_1"])
def test_greedy_equals_transformers(name, ngram):
    model = our_model(name)
    hf = hf_of(model, name)
    ids, mask = padded_batch()
    ours = greedy(Decoder(model, ids, mask), ids.shape[0], TOKENS,
                  DecodingSettings(max_new_tokens=12, no_repeat_ngram_size=ngram))
    with torch.no_grad():
        ref = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12,
                          do_sample=False, num_beams=1, no_repeat_ngram_size=ngram,
                          use_cache=False)  # (5.x: its cache assumes num_layers decoder layers)
    assert [h.ids for h in ours] == hf_rows(ref)


BEAM_CASES = [
    dict(num_beams=3, length_penalty=1.0, early_stopping=False, no_repeat_ngram_size=0),
    dict(num_beams=4, length_penalty=0.6, early_stopping=True, no_repeat_ngram_size=2),
    dict(num_beams=2, length_penalty=2.0, early_stopping="never", no_repeat_ngram_size=3),
]


@pytest.mark.parametrize("case", range(len(BEAM_CASES)))
@pytest.mark.parametrize("name", ["v1_0", "v1_1"])
def test_beam_search_equals_transformers(name, case):
    flags = BEAM_CASES[case]
    model = our_model(name, seed=case)
    hf = hf_of(model, name)
    ids, mask = padded_batch(seed=case)
    ours = beam_search(Decoder(model, ids, mask, expand=flags["num_beams"]), ids.shape[0],
                       TOKENS, DecodingSettings(max_new_tokens=10, **flags))
    with torch.no_grad():
        ref = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10,
                          do_sample=False, output_scores=True, return_dict_in_generate=True,
                          use_cache=False, **flags)
    assert [h.ids for h in ours] == hf_rows(ref.sequences)
    torch.testing.assert_close(torch.tensor([h.score for h in ours]), ref.sequences_scores,
                               rtol=1e-5, atol=1e-5)
    if name == "v1_1" and case < 2:  # hypotheses that end with EOS before the limit (the
        # third case's length penalty of 2 favours the long ones)
        assert any(h.ids[-1] == EOS and len(h.ids) < 10 for h in ours)


def test_sampling_is_reproducible_and_stays_in_the_top_k_and_top_p_sets():
    model = our_model("v1_1")
    ids, mask = padded_batch()

    def sampled(seed, **kw):
        settings = DecodingSettings(max_new_tokens=10, do_sample=True, seed=seed, **kw)
        return [h.ids for h in sample(Decoder(model, ids, mask), 3, TOKENS, settings)]

    assert sampled(5, top_k=20) == sampled(5, top_k=20)
    assert sampled(5) != sampled(6)
    for kw in (dict(top_k=3), dict(top_p=0.5), dict(temperature=0.7, top_k=5, top_p=0.8)):
        runs = sampled(7, **kw)
        decoder = Decoder(model, ids, mask)
        warpers = DecodingSettings(do_sample=True, **kw).processors(EOS)
        for t in range(max(len(r) for r in runs)):
            previous = [PAD if t == 0 else (r[t - 1] if t - 1 < len(r) else PAD) for r in runs]
            logits = decoder.step(torch.tensor(previous))
            allowed = apply(warpers, torch.zeros(3, t + 1, dtype=torch.long),
                            logits).isfinite()
            for row, run in enumerate(runs):
                if t < len(run) and (t == 0 or run[t - 1] != EOS):
                    assert allowed[row, run[t]], (kw, row, t)


def test_no_repeat_ngram_matches_its_definition():
    seq = torch.tensor([[0, 5, 6, 5, 7, 5]])
    scores = NoRepeatNGram(2)(seq, torch.zeros(1, 10))
    assert torch.isinf(scores[0]).nonzero().flatten().tolist() == [6, 7]


@pytest.mark.parametrize("router", ["switch", "topk", "base", "cpm2"])
def test_cached_steps_of_a_mixture_of_experts_model(router):
    """Sparse decoder blocks decode with their routers in evaluation mode: the cached steps
    give the plain forward's logits."""
    from generation_models import CONFIGS

    from megatron.model import T5Config, T5Model

    torch.manual_seed(4)
    config = T5Config(**CONFIGS["v1_1"], num_experts=4, encoder_sparse_step=2,
                      decoder_sparse_step=2, router_type=router)
    model = T5Model(config).eval()
    ids, mask = padded_batch()
    decoder = Decoder(model, ids, mask)
    dec = torch.cat([torch.full((3, 1), PAD), torch.randint(2, VOCAB, (3, 6))], dim=1)
    with torch.no_grad():  # (cpm2: test-time routing)
        full = model(ids, dec, mask, test_time_routing=True).logits[..., :VOCAB]
    for t in range(dec.shape[1]):
        torch.testing.assert_close(decoder.step(dec[:, t]), full[:, t], rtol=1e-5, atol=1e-5)


def test_cpm2_layers_route_each_token_to_its_best_centroid_while_decoding():
    """CPM-2-MoE's BASE layers at test time (BASE layers paper; fairseq's greedy_assignment):
    each token through the expert of its largest layer_norm(x) . centroid score, unscaled, by
    hand token by token; only when asked: without the argument the layer runs CPM-2's auction
    (which needs a multiple of 4 x 4 tokens)."""
    from generation_models import CONFIGS

    from megatron.model import T5Config, T5Model
    from megatron.model.moe_cpm2 import CPM2SparseMLP

    torch.manual_seed(6)
    config = T5Config(**CONFIGS["v1_1"], num_experts=4, encoder_sparse_step=2,
                      decoder_sparse_step=2, router_type="cpm2", router_centroid_gain=1.0)
    model = T5Model(config).eval()
    layer = next(m for m in model.modules() if isinstance(m, CPM2SparseMLP))
    hidden = torch.randn(3, 5, config.d_model)  # 15 tokens: no multiple of 4 x 4
    with torch.no_grad():
        got, aux = layer(hidden, test_time_routing=True)
        assert aux is None
        with pytest.raises(ValueError, match="not a multiple of experts x local experts"):
            layer(hidden)
        tokens = hidden.reshape(-1, config.d_model)
        best = (tokens @ layer.router.expert_centroids.T).argmax(dim=-1)
        assert len(set(best.tolist())) > 1  # the test routes to several experts
        expected = torch.stack([
            layer.experts(t[None], torch.nn.functional.one_hot(e, 4))[0]
            for t, e in zip(tokens, best)])
        torch.testing.assert_close(got.reshape(-1, config.d_model), expected,
                                   rtol=1e-5, atol=1e-6)
        with pytest.raises(ValueError, match="not a multiple"):
            layer(hidden)  # outside decoding: CPM-2's shuffle and auction, as in training
