"""Our Mixture-of-Experts T5 against Hugging Face's SwitchTransformersForConditionalGeneration:
a randomly initialised folder written by `save_pretrained` (untied head, sparse steps that differ
between the encoder and the decoder), read by our folder reader; logits, router z-loss and
auxiliary loss, in fp32 with nothing dropped; and our export loaded back into transformers."""

import pytest
import torch
from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

from megatron.checkpoint.formats.hf import read_hf_checkpoint
from megatron.model import T5Model
from megatron.model.moe import SparseMLP, load_balancing_loss, router_z_loss
from megatron.model.state_dict import load_full_state_dict

from moe_batches import VOCAB, batch

FIELDS = dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_heads=4, num_experts=4,
              expert_capacity=1000, router_jitter_noise=0.0, dropout_rate=0.0,
              tie_word_embeddings=False, router_z_loss_coef=0.003, router_aux_loss_coef=0.02)
LAYOUTS = {
    # encoder: 3 blocks, step 3 (block 1 sparse); decoder: 4 blocks, step 2 (blocks 1 and 3)
    "unusual": dict(num_layers=3, num_sparse_encoder_layers=1, num_decoder_layers=4,
                    num_sparse_decoder_layers=2),
    # one sparse block per stack, where Hugging Face's auxiliary loss is a per-layer sum
    "one_per_stack": dict(num_layers=2, num_sparse_encoder_layers=1, num_decoder_layers=3,
                          num_sparse_decoder_layers=1),
}


def switch_folder(tmp_path, layout, seed=0):
    torch.manual_seed(seed)
    hf = SwitchTransformersForConditionalGeneration(
        SwitchTransformersConfig(**FIELDS, **LAYOUTS[layout]))
    hf.lm_head.weight = torch.nn.Parameter(torch.randn_like(hf.lm_head.weight) * 0.1)
    # transformers 5.x unties the stacks' embeddings too when the head is untied; a T5 has one
    hf.encoder.embed_tokens = hf.decoder.embed_tokens = hf.shared
    with torch.no_grad():  # Hugging Face's router starts at std 1: a peaked, readable routing
        for name, p in hf.named_parameters():
            if "router" in name:
                p.normal_(0, 0.5)
    hf.save_pretrained(tmp_path)
    return hf.eval()


def ours_from(folder):
    config, full = read_hf_checkpoint(folder)
    model = T5Model(config, attention_backend="eager")
    load_full_state_dict(model, full)
    return model


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_logits_and_router_losses_equal_hugging_face(tmp_path, layout):
    hf = switch_folder(tmp_path, layout)
    ours = ours_from(tmp_path)
    assert [i for i, b in enumerate(ours.encoder.block) if b.is_sparse] == \
        [i for i, b in enumerate(hf.encoder.block) if b.is_sparse]
    assert [i for i, b in enumerate(ours.decoder.block) if b.is_sparse] == \
        [i for i, b in enumerate(hf.decoder.block) if b.is_sparse]
    enc, dec, labels = batch()
    ref = hf(input_ids=enc, decoder_input_ids=dec, labels=labels, output_router_logits=True)
    ours.eval()
    with torch.no_grad():
        out = ours(enc, dec, labels=labels)
    scale = float(ref.logits.detach().abs().max())
    assert torch.allclose(out.logits[..., :VOCAB], ref.logits, rtol=1e-5, atol=1e-5 * scale)
    # the router losses, from the training forward (dropout is 0: the same logits)
    ours.train()
    logits = {}
    hooks = [m.router.register_forward_hook(
        lambda mod, inp, res, name=name: logits.__setitem__(name, res))
        for name, m in ours.named_modules() if isinstance(m, SparseMLP)]
    train_out = ours(enc, dec, labels=labels)
    for h in hooks:
        h.remove()
    objective_aux = 0.0
    for stack, z_ref, aux_ref in (("encoder", ref.encoder_z_loss, ref.encoder_aux_loss),
                                  ("decoder", ref.decoder_z_loss, ref.decoder_aux_loss)):
        mine = [v for k, v in logits.items() if k.startswith(stack)]
        z = torch.stack([router_z_loss(v) for v in mine]).mean()
        assert torch.allclose(z, z_ref, rtol=1e-5), (stack, z, z_ref)
        aux = torch.stack([load_balancing_loss(v.softmax(-1), v.argmax(-1, keepdim=True))
                           for v in mine]).mean()
        objective_aux += FIELDS["router_aux_loss_coef"] * aux + FIELDS["router_z_loss_coef"] * z
        if len(mine) == 1:
            assert torch.allclose(aux, aux_ref, rtol=1e-5), (stack, aux, aux_ref)
        else:  # Hugging Face averages f and P over the stack's layers before their product
            f = torch.cat([torch.nn.functional.one_hot(v.argmax(-1), 4).float() for v in mine],
                          1).mean(1)
            p = torch.cat([v.softmax(-1) for v in mine], 1).mean(1)
            assert torch.allclose((f * p).mean() * 16, aux_ref, rtol=1e-5)
    # each stack's sparse layers weigh 1 / their count (Hugging Face's z-loss normalisation)
    assert torch.allclose(train_out.aux_loss, objective_aux, rtol=1e-5)
    if layout == "one_per_stack":  # the training objective as a whole
        assert torch.allclose(train_out.objective, ref.loss, rtol=1e-5), \
            (train_out.objective, ref.loss)
