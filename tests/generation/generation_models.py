"""Tiny models with the same weights in our code and in transformers, and a padded batch."""

import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from megatron.model import T5Config, T5Model  # noqa: E402
from megatron.model.state_dict import gather_full_state_dict, to_hf_state_dict  # noqa: E402

VOCAB = 300
EOS, PAD = 1, 0
CONFIGS = {
    "v1_0": dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                 feed_forward_proj="relu", tie_word_embeddings=True, dropout_rate=0.0),
    "v1_1": dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2,
                 num_decoder_layers=3, num_heads=4, feed_forward_proj="gated-gelu",
                 tie_word_embeddings=False, dropout_rate=0.0),
}


def our_model(name: str, seed: int = 0, **kw) -> T5Model:
    torch.manual_seed(seed)
    model = T5Model(T5Config(**CONFIGS[name]), **kw)
    sharpen(model)
    return model.eval()


def sharpen(model: T5Model) -> None:
    """Scale the embedding (and head) so that a random model's next-token distribution is
    peaked: searches then differ. An untied head's EOS row is pointed along the decoder's mean
    output, so that EOS comes up after a few tokens and some hypotheses end before the limit
    (a tied model's EOS row is also its input embedding, which this would disturb)."""
    with torch.no_grad():
        model.shared.weight.mul_(3.0)
        if hasattr(model, "lm_head"):
            model.lm_head.weight.mul_(3.0)
            ids, mask = padded_batch(seed=9)
            dec = torch.randint(2, VOCAB, (3, 6), generator=torch.Generator().manual_seed(9))
            was = model.training
            carry = model.eval().initial_carry(ids, dec, mask,  # any token count (router cpm2)
                                               test_time_routing=True)
            hidden = model.run_layers(carry).hidden
            model.train(was)
            mean = hidden.reshape(-1, hidden.shape[-1]).mean(0)
            head = model.lm_head.weight
            head[EOS] = mean / mean.norm() * head[:VOCAB].norm(dim=1).mean() * 1.5


def hf_model(name: str, full):
    """transformers' T5ForConditionalGeneration with our full state dict `full`."""
    from transformers import T5Config as HFConfig
    from transformers import T5ForConditionalGeneration

    fields = CONFIGS[name]
    hf = T5ForConditionalGeneration(HFConfig(**fields, attn_implementation="eager",
                                             eos_token_id=EOS, pad_token_id=PAD,
                                             decoder_start_token_id=PAD))
    if not fields["tie_word_embeddings"]:  # transformers 5.x ties on construction
        hf.lm_head.weight = torch.nn.Parameter(torch.empty_like(hf.lm_head.weight))
    missing, unexpected = hf.load_state_dict(
        to_hf_state_dict(full, T5Config(**fields)), strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    return hf.eval()


def hf_of(model: T5Model, name: str):
    return hf_model(name, gather_full_state_dict(model))


def padded_batch(seed: int = 0, batch: int = 3, length: int = 10):
    """(ids, attention mask): EOS-terminated inputs of different lengths, padded."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    for row, n in enumerate([length, length - 4, length - 2][:batch]):
        ids[row, n - 1] = EOS
        ids[row, n:] = PAD
        mask[row, n:] = 0
    return ids, mask


def hf_rows(sequences: torch.Tensor):
    """transformers' output rows as our ids: the decoder start dropped, cut after EOS."""
    out = []
    for row in sequences[:, 1:].tolist():
        out.append(row[:row.index(EOS) + 1] if EOS in row else row)
    return out


def same_outputs(a: str, b: str) -> None:
    """Two OUT.jsonl texts: the same ids and text; scores to float32 rounding (the tensor-
    parallel sums add in another order)."""
    a, b = [[json.loads(line) for line in t.splitlines()] for t in (a, b)]
    assert [(r["ids"], r["text"]) for r in a] == [(r["ids"], r["text"]) for r in b]
    scores = [[r.get("score", 0.0) for r in t] for t in (a, b)]
    assert scores[0] == pytest.approx(scores[1], rel=1e-5)
