"""The 'cpm2' router against CPM-2-MoE's own code: its libbase auction and its BaseLayer, whose
outputs tests/data/cpm2_moe/ stores (written by their code, see its README); and where the
router is defined (EP = DP, the token multiple), refused elsewhere by flag."""

import sys
from pathlib import Path

import pytest
import torch

from megatron.model.balanced_assignment import cpm2_assignment
from megatron.model.config import ConfigError, T5Config

FIXTURES = Path(__file__).resolve().parents[1] / "data" / "cpm2_moe"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))


def auction_cases():
    return torch.load(FIXTURES / "auction.pt", weights_only=True)


@pytest.mark.parametrize("case", auction_cases(), ids=lambda c: c["name"])
def test_the_auction_is_libbases_token_for_token(case):
    """The same tokens for the same experts in the same order as CPM-2's libbase, ties, a run
    past its 100 exact rounds and an answer that is not a permutation included."""
    got = cpm2_assignment(case["scores"][None])[0]
    assert torch.equal(got, case["assignment"]), case["name"]


def test_the_auction_replaces_non_finite_scores_as_cpm2_does():
    scores = torch.randn(1, 32, 4, generator=torch.Generator().manual_seed(0))
    broken = scores.clone()
    broken[0, 3, 1] = float("nan")
    broken[0, 7, 2] = float("inf")
    patched = broken.clone()
    patched[~broken.isfinite()] = broken[broken.isfinite()].min()
    assert torch.equal(cpm2_assignment(broken), cpm2_assignment(patched))
    with pytest.raises(ValueError, match="equal shares"):
        cpm2_assignment(torch.randn(1, 30, 4))


def test_a_duplicated_token_is_repaired_where_cpm2_would_compute_garbage():
    """libbase's answer on equal scores can hold a token twice and miss another (the stored
    all-zero case); CPM-2 would then run some tokens twice and return uninitialised rows for the
    missed ones. The layer keeps each token's first slot and gives the repeated slots to the
    missed tokens: every expert still gets its equal share, every token one expert."""
    from megatron.model.moe_cpm2 import repair_assignment

    case = next(c for c in auction_cases() if not c["is_permutation"])
    order = case["assignment"][None]
    fixed = repair_assignment(order)
    tokens = order.shape[1]
    assert torch.equal(fixed.sort(dim=1).values[0], torch.arange(tokens))
    seen = set()
    for slot, token in enumerate(order[0].tolist()):
        if token not in seen:  # first occurrences keep their slot (their expert)
            assert fixed[0, slot] == token
        seen.add(token)
    good = torch.randperm(64)[None]
    assert repair_assignment(good) is good


@pytest.mark.slow
@pytest.mark.parametrize("name", ["base_layer_dp2.pt", "base_layer_dp4.pt",
                                  "base_layer_dp2_mp2.pt"])
def test_the_router_is_cpm2s_base_layer(name):
    """Our sparse feed-forward with router 'cpm2' on CPM-2's layout (one expert per data-parallel
    rank; with their model parallelism as our tensor parallelism) and CPM-2's weights: its
    output, input gradient and every expert gradient are their BaseLayer's to 1e-5; the layer
    norm's gradient summed over the data-parallel ranks too (CPM-2 averages it over them: its
    copies in the experts are one shared weight); the centroids get none."""
    from harness import run_workers
    import cpm2_workers

    fixture = torch.load(FIXTURES / name, weights_only=True)
    got = run_workers(fixture["world_size"], cpm2_workers.base_layer_step, name)
    dp, mp = fixture["data_parallel_size"], fixture["model_parallel_size"]
    theirs_norm = {}
    for rank, (ours, theirs) in enumerate(zip(got, fixture["ranks"])):
        for key in ("out", "x_grad"):
            torch.testing.assert_close(ours[key], theirs[key], rtol=1e-5, atol=1e-5)
        for n in ("wi_0", "wi_1", "wo"):
            torch.testing.assert_close(ours["grads"][n],
                                       theirs["grads"][f"expert_network.dense_relu_dense.{n}"
                                                       ".weight"], rtol=1e-5, atol=1e-5)
        assert ours["aux"] is None and ours["centroids_grad"] is None
        assert theirs["grads"]["expert_centroids"] is None
        norm = theirs["grads"]["expert_network.layer_norm.weight"]
        theirs_norm[theirs["mp_rank"]] = theirs_norm.get(theirs["mp_rank"], 0) + norm
    assert len(theirs_norm) == mp
    for ours, theirs in zip(got, fixture["ranks"]):
        torch.testing.assert_close(ours["layer_norm_sum"], theirs_norm[theirs["mp_rank"]],
                                   rtol=1e-5, atol=1e-5)
    assert dp * mp == len(got)


def test_config_refuses_what_cpm2_routing_has_not():
    base = dict(vocab_size=64, d_model=16, d_ff=24, num_layers=1, num_heads=2, d_kv=8,
                num_experts=2, router_type="cpm2")
    T5Config(**base)
    for extra, flag in ((dict(expert_capacity_factor=1.0), "expert_capacity_factor"),
                        (dict(moe_expert_bias=True), "moe_expert_bias"),
                        (dict(router_jitter_noise=0.1), "router_jitter_noise"),
                        (dict(router_centroid_gain=0.0), "router_centroid_gain")):
        with pytest.raises(ConfigError, match=flag):
            T5Config(**base, **extra)
    assert "router_centroid_gain" in T5Config(**base).to_dict()
    assert "router_centroid_gain" not in T5Config(**{**base, "router_type": "base"}).to_dict()


def test_a_switch_transformers_export_of_cpm2_routing_is_refused():
    from megatron.checkpoint.formats.switch import export_problems

    config = T5Config(vocab_size=64, d_model=16, d_ff=24, num_layers=1, num_heads=2, d_kv=8,
                      num_experts=2, router_type="cpm2")
    never, _ = export_problems(config)
    assert any("router_type 'cpm2'" in p and "--to cpm2" in p for p in never)
