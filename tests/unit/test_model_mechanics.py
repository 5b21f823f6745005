"""Activation checkpointing, the flat layer list, dropout streams and the FLOPs formula."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megatron.model import T5Config, T5Model, load_preset
from megatron.model.flops import forward_flops_per_sample, training_step_flops
from megatron.model.meta import num_parameters
from megatron.model.transformer import T5Block
from megatron.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_seed

FIELDS = dict(vocab_size=300, d_model=32, d_kv=8, d_ff=48, num_layers=3, num_decoder_layers=2,
              num_heads=4, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
              dropout_rate=0.2)


def batch():
    g = torch.Generator().manual_seed(0)
    enc = torch.randint(2, 300, (2, 11), generator=g)
    dec = torch.randint(2, 300, (2, 6), generator=g)
    labels = torch.randint(2, 300, (2, 6), generator=g)
    enc_mask = torch.ones(2, 11, dtype=torch.long)
    enc_mask[1, 8:] = 0
    return enc, dec, enc_mask, None, labels


def loss_and_grads(model, seed=7):
    model_parallel_seed(seed)
    model.zero_grad(set_to_none=True)
    out = model(*batch())
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("backend", ["eager", "sdpa", "auto"])
@pytest.mark.parametrize("chunk", [1, 2])
def test_checkpointing_gives_bit_identical_gradients_with_dropout(backend, chunk):
    model_parallel_seed(0)
    model = T5Model(T5Config(**FIELDS), attention_backend=backend).train()
    loss, grads = loss_and_grads(model)
    model.checkpoint_activations, model.checkpoint_num_layers = True, chunk
    loss_ckpt, grads_ckpt = loss_and_grads(model)
    assert torch.equal(loss, loss_ckpt)
    for name in grads:
        assert torch.equal(grads[name], grads_ckpt[name]), name
    # The dropout draws differ from a run with another seed: the test would notice a mask change.
    other, _ = loss_and_grads(model, seed=8)
    assert not torch.equal(loss, other)


def test_checkpointing_restores_the_random_streams():
    model_parallel_seed(0)
    model = T5Model(T5Config(**FIELDS), checkpoint_activations=True).train()
    loss_and_grads(model)
    after_ckpt = (torch.get_rng_state(), get_cuda_rng_tracker().get_states())
    model.checkpoint_activations = False
    loss_and_grads(model)
    after_plain = (torch.get_rng_state(), get_cuda_rng_tracker().get_states())
    assert torch.equal(after_ckpt[0], after_plain[0])
    assert all(torch.equal(after_ckpt[1][k], after_plain[1][k]) for k in after_plain[1])


def test_layers_can_be_cut_anywhere():
    torch.manual_seed(0)
    model = T5Model(T5Config(**dict(FIELDS, dropout_rate=0.0))).eval()
    enc, dec, enc_mask, dec_mask, labels = batch()
    whole = model(enc, dec, enc_mask, dec_mask).logits
    layers = model.layers()
    assert len(layers) == 3 + 2 + 4 and sum(isinstance(x, T5Block) for x in layers) == 5
    for cut in range(1, len(layers)):
        carry = model.initial_carry(enc, dec, enc_mask, dec_mask)
        carry = model.run_layers(model.run_layers(carry, layers[:cut]), layers[cut:])
        assert torch.equal(model.lm_logits(carry.hidden), whole)


def test_dropout_streams_are_separate():
    """Dropout on sharded activations draws from the tracker, not the default generator."""
    model_parallel_seed(0)
    model = T5Model(T5Config(**FIELDS)).train()
    before = torch.get_rng_state()
    tracker_before = get_cuda_rng_tracker().get_states()
    with torch.no_grad():
        model(*batch())
    assert not torch.equal(before, torch.get_rng_state())
    assert not torch.equal(tracker_before["model-parallel-rng"],
                           get_cuda_rng_tracker().get_states()["model-parallel-rng"])


def test_flops_hand_count():
    config = T5Config(vocab_size=100, d_model=8, d_kv=2, d_ff=16, num_layers=1,
                      num_decoder_layers=1, num_heads=2, feed_forward_proj="relu")
    # inner = 4. Encoder token: 2*(4*8*4 + 2*8*16) + 4*enc_len*4; enc_len 5 -> 2*(128+256)+80
    # = 848, times 5 tokens = 4240. Decoder token: 2*(6*8*4 + 2*8*16) + 4*3*4 + 4*5*4 = 2*(192+256)
    # + 48 + 80 = 1024, times 3 tokens = 3072. Cross K/V: 5 tokens * 4*8*4 = 640. Head: 3*2*8*100
    # = 4800. Forward 12752 per sample; training 3x; 2 samples.
    parts = forward_flops_per_sample(config, enc_len=5, dec_len=3, vocab_size=100)
    assert parts == {"encoder": 4240, "decoder": 3072, "cross_kv": 640, "lm_head": 4800}
    flops = training_step_flops(config, samples=2, enc_len=5, dec_len=3, vocab_size=100)
    assert flops.model == 2 * 3 * 12752 == flops.hardware
    recomputed = training_step_flops(config, 2, 5, 3, 100, recompute_activations=True)
    assert recomputed.hardware == flops.model + 2 * (4240 + 3072 + 640)


@pytest.mark.parametrize("ff", ["relu", "gated-gelu"])
def test_flops_formula_equals_torch_flop_counter(ff):
    config = T5Config(**dict(FIELDS, feed_forward_proj=ff, dropout_rate=0.0))
    model = T5Model(config, attention_backend="eager")
    enc, dec, enc_mask, dec_mask, labels = batch()
    with FlopCounterMode(display=False) as counter:
        model(enc, dec, enc_mask, dec_mask, labels).loss.backward()
    expected = training_step_flops(config, samples=2, enc_len=11, dec_len=6,
                                   vocab_size=model.padded_vocab_size)
    assert counter.get_total_flops() == expected.model


def test_decoder_only_shortcut_overcounts():
    config = load_preset("t5-v1_1-base")
    ours = training_step_flops(config, 1, 512, 114, config.padded_vocab_size()).model
    shortcut = 6 * num_parameters(config, 128) * (512 + 114)
    assert 1.5 < shortcut / ours < 2.5


def test_cpu_dropout_statistics_and_gradient():
    from megatron.model.dropout import dropout
    torch.manual_seed(0)
    x = torch.full((1_000_000,), 2.0, requires_grad=True)
    y = dropout(x, 0.25)
    dropped = (y == 0).float().mean().item()
    assert abs(dropped - 0.25) < 0.002  # 1e6 draws: standard error 4e-4
    assert torch.equal(y[y != 0], torch.full_like(y[y != 0], 2.0 / 0.75))
    y.sum().backward()
    assert torch.equal(x.grad, (y.detach() != 0).float() / 0.75)
    assert dropout(x, 0.25, training=False) is x and dropout(x, 0.0) is x


def test_cpu_keep_mask_halves_are_independent():
    """Each 32-bit draw gives two neighbouring elements: both halves drop at rate p, and together
    at p^2 (a shared or constant bit would show in one of the three)."""
    from megatron.model.dropout import keep_mask
    torch.manual_seed(1)
    keep = keep_mask((999, 1001), 0.3, "cpu")  # odd count: the last draw is half used
    assert keep.shape == (999, 1001) and keep.untyped_storage().nbytes() == 999 * 1001
    pairs = ~keep.reshape(-1)[:-1].view(-1, 2)
    assert abs(pairs[:, 0].float().mean().item() - 0.3) < 0.003  # 5e5 draws: s.e. 6.5e-4
    assert abs(pairs[:, 1].float().mean().item() - 0.3) < 0.003
    assert abs((pairs[:, 0] & pairs[:, 1]).float().mean().item() - 0.09) < 0.002


def test_loss_backward_twice_is_refused():
    from megatron.tensor_parallel import SINGLE, vocab_parallel_cross_entropy
    logits = torch.randn(2, 3, 10, requires_grad=True)
    loss = vocab_parallel_cross_entropy(logits, torch.tensor([[1, 2, -100], [0, 9, 4]]),
                                        tp=SINGLE).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="cannot run twice"):
        loss.backward()
