"""Our T5Model against Hugging Face's T5ForConditionalGeneration with the same weights: logits,
loss and every gradient, on padded batches, for a v1.0 config (relu, tied) and a v1.1 config
(gated-gelu, untied, more decoder than encoder layers); weights moved in both directions; in
fp32, and in bf16 (parameters, or autocast) against Hugging Face in bf16."""

import pytest
import torch
from transformers import T5Config as HFConfig
from transformers import T5ForConditionalGeneration

from megatron.model import T5Config, T5Model
from megatron.model.state_dict import (
    StateDictError,
    from_hf_state_dict,
    gather_full_state_dict,
    load_full_state_dict,
    to_hf_state_dict,
)

VOCAB = 300
CONFIGS = {
    "v1_0": dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                 feed_forward_proj="relu", tie_word_embeddings=True, dropout_rate=0.0),
    "v1_1": dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2,
                 num_decoder_layers=3, num_heads=4, feed_forward_proj="gated-gelu",
                 tie_word_embeddings=False, dropout_rate=0.0),
}
# Tolerances are relative: to each value, and to the tensor's largest value for elements near zero
# (their float32 rounding error scales with the tensor's magnitude, not with their own).


def hf_model(fields):
    """A Hugging Face reference; transformers 5.x ties lm_head to the embedding on
    construction, so an untied config gets its own lm_head weight here."""
    hf = T5ForConditionalGeneration(HFConfig(**fields, attn_implementation="eager"))
    if not fields["tie_word_embeddings"]:
        hf.lm_head.weight = torch.nn.Parameter(torch.randn_like(hf.lm_head.weight))
    assert (hf.lm_head.weight is hf.shared.weight) == fields["tie_word_embeddings"]
    return hf.eval()


def padded_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    batch, enc_len, dec_len = 3, 12, 7
    enc = torch.randint(2, VOCAB, (batch, enc_len), generator=g)
    dec = torch.randint(2, VOCAB, (batch, dec_len), generator=g)
    labels = torch.randint(2, VOCAB, (batch, dec_len), generator=g)
    enc_mask = torch.ones(batch, enc_len, dtype=torch.long)
    enc_mask[1, 7:] = 0
    enc_mask[2, 10:] = 0
    dec_mask = torch.ones(batch, dec_len, dtype=torch.long)
    dec_mask[2, 4:] = 0
    labels[2, 4:] = -100
    return enc, dec, enc_mask, dec_mask, labels


def compare(hf, ours):
    enc, dec, enc_mask, dec_mask, labels = padded_batch()
    ref = hf(input_ids=enc, attention_mask=enc_mask, decoder_input_ids=dec,
             decoder_attention_mask=dec_mask, labels=labels)
    out = ours(enc, dec, enc_mask, dec_mask, labels)
    assert out.logits.shape[-1] == ours.padded_vocab_size
    torch.testing.assert_close(out.logits[..., :VOCAB], ref.logits, rtol=1e-5,
                               atol=1e-5 * ref.logits.abs().max().item())
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-6, atol=0)
    grads, ref_grads = backward_both(ours, out, hf, ref)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5,
                                   atol=1e-5 * ref_grads[name].abs().max().item(), msg=name)


def backward_both(ours, out, hf, ref):
    """(our full gradients, Hugging Face's under our names) after both losses' backward; both
    cover every parameter of ours."""
    ref.loss.backward()
    out.loss.backward()
    ref_grads = from_hf_state_dict(
        {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}, ours.config)
    grads = gather_full_state_dict(ours, grads=True)
    assert set(grads) == set(ref_grads) == {n for n, _ in ours.named_parameters()}
    return grads, ref_grads


@pytest.mark.parametrize("backend", ["eager", "sdpa", "auto"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_hugging_face_weights_into_ours(name, backend):
    torch.manual_seed(1)
    hf = hf_model(CONFIGS[name])
    ours = T5Model(T5Config(**CONFIGS[name]), attention_backend=backend)  # vocab padded to 384
    load_full_state_dict(ours, from_hf_state_dict(hf.state_dict(), ours.config))
    compare(hf, ours)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_our_weights_into_hugging_face(name):
    torch.manual_seed(2)
    ours = T5Model(T5Config(**CONFIGS[name]), make_vocab_size_divisible_by=1)
    hf = hf_model(CONFIGS[name])
    missing, unexpected = hf.load_state_dict(
        to_hf_state_dict(gather_full_state_dict(ours), ours.config), strict=False)
    assert not unexpected and not missing
    compare(hf, ours)


def test_label_smoothing_matches_torch():
    torch.manual_seed(3)
    model = T5Model(T5Config(**CONFIGS["v1_1"]), label_smoothing=0.1)
    enc, dec, enc_mask, dec_mask, labels = padded_batch()
    out = model(enc, dec, enc_mask, dec_mask, labels)
    ref = torch.nn.functional.cross_entropy(out.logits[..., :VOCAB].reshape(-1, VOCAB),
                                            labels.reshape(-1), label_smoothing=0.1)
    torch.testing.assert_close(out.loss, ref, rtol=1e-6, atol=0)
    logits = out.logits.detach().requires_grad_()
    loss, _ = model.loss(logits, labels)
    loss.backward()
    ref_logits = out.logits.detach()[..., :VOCAB].clone().requires_grad_()
    torch.nn.functional.cross_entropy(ref_logits.reshape(-1, VOCAB), labels.reshape(-1),
                                      label_smoothing=0.1).backward()
    torch.testing.assert_close(logits.grad[..., :VOCAB], ref_logits.grad, rtol=1e-6,
                               atol=1e-6 * ref_logits.grad.abs().max().item())
    assert torch.count_nonzero(logits.grad[..., VOCAB:]) == 0  # padded columns get nothing


def relative_error(got, want):
    """||got - want|| / ||want||, in fp32."""
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def compare_bf16(hf, ours, autocast):
    """Ours against Hugging Face, both in bf16 (bf16 parameters, or fp32 ones under autocast),
    with the same weights and batch. The tolerances are relative norms, about twice the worst
    seen (logits 1.2%, one gradient 12.5%, all gradients together 4.2%), which is what Hugging
    Face's own bf16 run is off its fp32 run (logits 0.6-0.8%, one gradient up to 14%, the
    relu model's small ones worst): a uniform output, whose loss ln V a tiny random model
    nearly has, is off by 100%."""
    enc, dec, enc_mask, dec_mask, labels = padded_batch()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        ref = hf(input_ids=enc, attention_mask=enc_mask, decoder_input_ids=dec,
                 decoder_attention_mask=dec_mask, labels=labels)
        out = ours(enc, dec, enc_mask, dec_mask, labels)
    assert out.logits.dtype == ref.logits.dtype == torch.bfloat16
    assert relative_error(out.logits[..., :VOCAB], ref.logits) < 0.03
    # our loss is fp32 math on the bf16 logits; Hugging Face's is bf16 without autocast
    want = torch.nn.functional.cross_entropy(ref.logits.float().reshape(-1, VOCAB),
                                             labels.reshape(-1))
    torch.testing.assert_close(out.loss, want, rtol=1e-2, atol=0)
    grads, ref_grads = backward_both(ours, out, hf, ref)
    for name, grad in grads.items():
        assert grad.dtype == ref_grads[name].dtype == next(ours.parameters()).dtype, name
        assert relative_error(grad, ref_grads[name]) < 0.25, name
    assert relative_error(torch.cat([g.flatten().float() for g in grads.values()]),
                          torch.cat([ref_grads[n].flatten().float() for n in grads])) < 0.1


@pytest.mark.parametrize("backend", ["eager", "sdpa", "auto"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_bf16_autocast_matches_hugging_face(name, backend):
    torch.manual_seed(4)
    hf = hf_model(CONFIGS[name])
    ours = T5Model(T5Config(**CONFIGS[name]), attention_backend=backend)
    load_full_state_dict(ours, from_hf_state_dict(hf.state_dict(), ours.config))
    compare_bf16(hf, ours, autocast=True)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_bf16_parameters_match_hugging_face(name):
    torch.manual_seed(5)
    hf = hf_model(CONFIGS[name])
    ours = T5Model(T5Config(**CONFIGS[name]), dtype=torch.bfloat16)
    load_full_state_dict(ours, from_hf_state_dict(hf.state_dict(), ours.config))
    compare_bf16(hf.to(torch.bfloat16), ours, autocast=False)


def test_state_dict_mismatches_are_listed():
    model = T5Model(T5Config(**CONFIGS["v1_1"]))
    full = gather_full_state_dict(model)
    full.pop("lm_head.weight")
    full["encoder.block.9.layer.0.layer_norm.weight"] = torch.ones(32)
    full["shared.weight"] = full["shared.weight"][:10]
    with pytest.raises(StateDictError) as err:
        load_full_state_dict(model, full)
    message = str(err.value)
    assert "missing: lm_head.weight" in message
    assert "unexpected: encoder.block.9.layer.0.layer_norm.weight" in message
    assert "shared.weight: 10 rows, the config's vocab_size is 300" in message
