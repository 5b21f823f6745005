"""Prompt tuning's model side (megatron/model/prompt.py): the layout of CPM-2-Finetune's
ratio_list, the reserved positions, the embedding, freezing and the base identity."""

import pytest
import torch

from megatron.model import T5Config, T5Model
from megatron.model.prompt import (PROMPT_PARAMETER, PromptLayout, attach_prompt, base_identity,
                                   base_mismatch, freeze_all_but_prompt, layout_problems,
                                   place_prompt)

FIELDS = dict(vocab_size=300, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2,
              num_heads=4, dropout_rate=0.0)


@pytest.mark.parametrize("ratios,counts", [((0.33, 0.34, 0.33), [33, 34, 33]),
                                           ((1.0, 0.0, 0.0), [100, 0, 0]),
                                           ((0.33, 0.34, 0.33, 0.0), [33, 34, 33, 0]),
                                           ((0.99, 0.01, 0.0), [99, 1, 0]),
                                           ((1.0,), [100])])
def test_counts_follow_cpm2_ratio_list(ratios, counts):
    assert PromptLayout(100, ratios).counts() == counts


def test_layout_problems_name_the_flags():
    assert layout_problems(100, (0.33, 0.34, 0.33)) == []
    assert "--prompt-length" in layout_problems(0, (1.0,))[0]
    assert "add up to 1" in layout_problems(10, (0.5, 0.2))[0]


def test_place_prompt_front_middle_back():
    ids = torch.tensor([[11, 12, 13, 14, 0, 0], [21, 22, 0, 0, 0, 0]])
    keep = ids != 0
    out, out_keep = place_prompt(ids, keep, PromptLayout(4, (0.25, 0.5, 0.25)))
    assert out.tolist() == [[-1, 11, 12, -2, -3, 13, 14, -4, 0, 0],
                            [-1, 21, -2, -3, 22, -4, 0, 0, 0, 0]]
    assert out_keep.tolist() == [[True] * 8 + [False] * 2, [True] * 6 + [False] * 4]


def test_place_prompt_front_only():
    ids = torch.tensor([[5, 6, 0]])
    out, keep = place_prompt(ids, ids != 0, PromptLayout(2))
    assert out.tolist() == [[-1, -2, 5, 6, 0]]
    assert keep.tolist() == [[True, True, True, True, False]]


def _batch():
    g = torch.Generator().manual_seed(0)
    enc = torch.randint(3, 300, (2, 9), generator=g)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    dec = torch.randint(3, 300, (2, 5), generator=g)
    return enc, mask, dec


def test_prompt_of_token_vectors_equals_the_tokens_in_the_text():
    """A prompt whose vectors are token 7's embedding gives the logits of the text with token 7
    written at the prompt's positions."""
    torch.manual_seed(0)
    model = T5Model(T5Config(**FIELDS)).eval()
    enc, mask, dec = _batch()
    layout = PromptLayout(5, (0.4, 0.2, 0.4))
    prompt = attach_prompt(model, layout)
    prompt.init_from_token(7, model.shared)
    got = model(enc, dec, mask).logits
    ids, keep = place_prompt(enc, mask.bool(), layout)
    model.prompt = None
    want = model(torch.where(ids < 0, 7, ids), dec, keep.long()).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_without_prompt_the_model_is_unchanged():
    torch.manual_seed(0)
    model = T5Model(T5Config(**FIELDS)).eval()
    enc, mask, dec = _batch()
    before = model(enc, dec, mask).logits
    prompt = attach_prompt(model, PromptLayout(3))
    model.prompt = None
    assert torch.equal(model(enc, dec, mask).logits, before)
    assert prompt.weight.shape == (3, 32)


def test_only_the_prompt_gets_a_gradient():
    torch.manual_seed(0)
    model = T5Model(T5Config(**FIELDS)).train()
    prompt = attach_prompt(model, PromptLayout(4, (0.5, 0.5)))
    prompt.init_random(torch.Generator().manual_seed(1))
    frozen = freeze_all_but_prompt(model)
    assert PROMPT_PARAMETER not in frozen and len(frozen) == len(list(model.parameters())) - 1
    enc, mask, dec = _batch()
    model(enc, dec, mask, labels=dec).loss.backward()
    assert prompt.weight.grad is not None and prompt.weight.grad.abs().sum() > 0
    assert all(p.grad is None for n, p in model.named_parameters() if n != PROMPT_PARAMETER)


def test_base_identity_tells_bases_apart():
    torch.manual_seed(0)
    a = T5Model(T5Config(**FIELDS))
    attach_prompt(a, PromptLayout(2))
    ida = base_identity(a, "base/", 10)
    a.prompt.init_random(torch.Generator().manual_seed(3))
    assert base_identity(a, "base/", 10)["digest"] == ida["digest"]  # the prompt is not the base
    assert base_mismatch(ida, base_identity(a, "base/", 10), "p/") is None
    with torch.no_grad():
        a.shared.weight[0, 0] += 1
    message = base_mismatch(ida, base_identity(a, "other/", 20), "p/")
    assert "base/ iteration 10" in message and "other/ iteration 20" in message
