"""Expert parallelism on real gloo process groups against the single-process model: the same
objective (loss plus balancing losses), logits and every gradient for EP = 2 and 4, with data
parallelism beside it, with TP = 2, and with activation checkpointing; top-k, switch and BASE
routing, with and without capacity."""

import pytest
import torch

from megatron.model import T5Config, T5Model
from megatron.model.state_dict import gather_full_state_dict

from harness import run_workers
import moe_workers

pytestmark = pytest.mark.slow

FIELDS = dict(vocab_size=300, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=3,
              num_heads=4, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
              dropout_rate=0.0, num_experts=4, decoder_sparse_step=2, router_type="topk",
              router_topk=2)


def assert_close(actual, expected, rtol, msg=None):
    torch.testing.assert_close(actual, expected, rtol=rtol,
                               atol=rtol * expected.abs().max().item(), msg=msg)


def reference(fields, batch):
    torch.manual_seed(7)
    model = T5Model(T5Config(**fields), attention_backend="eager")
    with torch.no_grad():  # a router that spreads the tokens unevenly
        for name, p in model.named_parameters():
            if "router" in name:
                p.normal_(0, 0.3)
    full = gather_full_state_dict(model)
    model.train()
    out = model(batch[0], batch[1], labels=batch[2])
    out.objective.backward()
    return full, out.objective.detach(), out.logits.detach()[..., :fields["vocab_size"]], \
        gather_full_state_dict(model, grads=True)


def make_batch(rows=4):
    g = torch.Generator().manual_seed(3)
    return (torch.randint(2, 300, (rows, 10), generator=g),
            torch.randint(2, 300, (rows, 6), generator=g),
            torch.randint(2, 300, (rows, 6), generator=g))


CASES = {
    "ep2": (2, 1, 2, {}, False),
    "ep2_dp2": (4, 1, 2, {}, False),
    "ep4": (4, 1, 4, {}, False),
    "ep2_tp2": (4, 2, 2, {}, False),
    "ep2_checkpointed": (2, 1, 2, {}, True),
    "ep2_capacity": (2, 1, 2, dict(expert_capacity_factor=0.75), False),
    "ep2_switch": (2, 1, 2, dict(router_type="switch"), False),
    "ep2_base": (2, 1, 2, dict(router_type="base"), False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_expert_parallel_equals_one_process(case):
    world, tp, ep, extra, checkpoint = CASES[case]
    fields = {**FIELDS, **extra}
    batch = make_batch()
    full, objective, logits, grads = reference(fields, batch)
    got = run_workers(world, moe_workers.expert_parallel_step, fields, full, batch, tp, ep,
                      checkpoint)
    assert_same_step(got, batch, world // tp, objective, logits, grads)


def assert_same_step(got, batch, data_parallel, objective, logits, grads):
    """The workers' objective, logits (their data rank's rows) and gradients are the single
    process's (rel 2e-5)."""
    rows = batch[0].shape[0] // data_parallel
    for out in got:
        assert_close(out["objective"], objective, 2e-5)
        d = out["data_rank"]
        assert_close(out["logits"], logits[d * rows:(d + 1) * rows], 2e-5)
    assert set(got[0]["grads"]) == set(grads)
    for name, grad in grads.items():
        assert_close(got[0]["grads"][name], grad, 2e-5, msg=name)
