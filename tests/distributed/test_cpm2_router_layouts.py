"""The 'cpm2' router (CPM-2-MoE's BASE layers) on real gloo process groups against one process
with the same experts: CPM-2 routes over the whole data-parallel group, so one process holding E
experts stands for E of CPM-2's ranks (its micro-batch cut in E), and EP = DP = 2 and 4, with
TP = 2 and with activation checkpointing, must give its objective, logits and every gradient.
Then the experts' loads: exactly equal in every layer and step."""

import pytest

from harness import run_workers
import moe_workers
from test_expert_parallel import FIELDS, assert_same_step, reference

pytestmark = pytest.mark.slow

CPM2 = {**FIELDS, "router_type": "cpm2", "encoder_sparse_step": 1, "decoder_sparse_step": 1,
        "router_centroid_gain": 1.0}


def make_batch(rows=4, encoder=8, decoder=4):
    """Tokens per rank a multiple of experts x local experts (4 x 4 in one process)."""
    import torch
    g = torch.Generator().manual_seed(5)
    return (torch.randint(2, 300, (rows, encoder), generator=g),
            torch.randint(2, 300, (rows, decoder), generator=g),
            torch.randint(2, 300, (rows, decoder), generator=g))


CASES = {  # world, tp, ep, activation checkpointing
    "ep2_2experts_each": (2, 1, 2, False),
    "ep4": (4, 1, 4, False),
    "ep2_tp2": (4, 2, 2, False),
    "ep4_checkpointed": (4, 1, 4, True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_cpm2_router_on_any_layout_equals_one_process(case):
    world, tp, ep, checkpoint = CASES[case]
    batch = make_batch()
    full, objective, logits, grads = reference(CPM2, batch)
    got = run_workers(world, moe_workers.expert_parallel_step, CPM2, full, batch, tp, ep,
                      checkpoint)
    assert not any("centroids" in name for name in grads)  # frozen: no gradient
    assert_same_step(got, batch, world // tp, objective, logits, grads)
