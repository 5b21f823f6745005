"""The Mixture-of-Experts routing (megatron/model/moe.py) against hand computations: dropless
top-k and switch, the capacity queue (first choices before second ones, earlier positions
first, per sequence) and the zero output of a dropped token, the capacity formula in training
and evaluation, the expert bias, the grouped multiply against a loop over experts, the balancing
losses, BASE routing, and the statistics a layer records (once under activation checkpointing).

Where a layer's routing must be known in advance, its router is the identity on the first
`num_experts` features times `SHARP` and the tokens' first features are written by hand: a
token's logits are then SHARP x those features, whatever its other features hold."""

import itertools
import math

import pytest
import torch

from megatron.model.config import T5Config
from megatron.model.moe import (
    SparseMLP,
    capacity_keep,
    grouped_linear,
    load_balancing_loss,
    padded_grouped_linear,
    route,
    router_z_loss,
    update_expert_bias,
)
from megatron.model.transformer import InitMethods
from megatron.tensor_parallel.group import NO_EXPERT_PARALLEL, SINGLE
from megatron.tensor_parallel.random import checkpoint

E = 4
D_MODEL = 8
SHARP = 10.0


def layer(**fields) -> SparseMLP:
    """A sparse feed-forward of E experts, relu, no dropout, one sparse layer in its stack."""
    config = T5Config(**{**dict(vocab_size=32, d_model=D_MODEL, d_kv=4, d_ff=12, num_layers=1,
                                num_heads=2, dropout_rate=0.0, feed_forward_proj="relu",
                                num_experts=E), **fields})
    torch.manual_seed(0)
    return SparseMLP(config, InitMethods(config, 1), tp=SINGLE, ep=NO_EXPERT_PARALLEL,
                     sparse_layers=1)


def steer(mlp: SparseMLP) -> SparseMLP:
    """The router made SHARP x the identity on the first E features (module docstring)."""
    with torch.no_grad():
        mlp.router.classifier.weight.zero_()
        mlp.router.classifier.weight[:, :E] = SHARP * torch.eye(E)
    return mlp


def tokens(preferences) -> torch.Tensor:
    """[B, S, D_MODEL] hidden states whose first E features are `preferences` [B, S, E] and the
    rest random (the router does not read them, the experts do)."""
    preferences = torch.as_tensor(preferences, dtype=torch.float32)
    rest = torch.randn(*preferences.shape[:-1], D_MODEL - E,
                       generator=torch.Generator().manual_seed(1))
    return torch.cat([preferences, rest], dim=-1)


def expert(mlp: SparseMLP, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert e of a relu layer on one token, written out."""
    wi, wo = mlp.experts.wi[e], mlp.experts.wo[e]
    return wo @ torch.relu(wi @ x)


def random_logits(shape, seed=0, scale=2.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


# Dropless routing -------------------------------------------------------------------------------

def test_topk_dropless_sends_every_token_to_its_k_most_probable_experts():
    logits = random_logits((2, 7, 6))
    probs = logits.softmax(-1)
    routing = route(logits, "topk", 3, None, training=True)
    expected = torch.topk(probs, 3, dim=-1).indices.reshape(14, 3)
    assert torch.equal(routing.experts.sort(-1).values, expected.sort(-1).values)
    picked = probs.reshape(14, 6).gather(-1, routing.experts)
    torch.testing.assert_close(routing.weights, picked / picked.sum(-1, keepdim=True))
    torch.testing.assert_close(routing.weights.sum(-1), torch.ones(14))
    assert routing.kept.all()


def test_switch_dropless_takes_the_most_probable_expert_weighted_by_its_probability():
    logits = random_logits((3, 5, E))
    probs = logits.softmax(-1).reshape(15, E)
    routing = route(logits, "switch", 1, None, training=True)
    assert torch.equal(routing.experts[:, 0], probs.argmax(-1))
    torch.testing.assert_close(routing.weights[:, 0], probs.max(-1).values)
    assert routing.kept.all()


def test_dropless_layer_output_is_the_weighted_sum_of_the_k_experts():
    mlp = layer(router_type="topk", router_topk=2)
    with torch.no_grad():  # a router that spreads the tokens over every expert
        mlp.router.classifier.weight.normal_(0, 1.0)
    hidden = torch.randn(2, 6, D_MODEL, generator=torch.Generator().manual_seed(2))
    out, _ = mlp(hidden)
    probs = mlp.router(hidden).softmax(-1)
    for b, s in itertools.product(range(2), range(6)):
        top = probs[b, s].topk(2)
        weights = top.values / top.values.sum()
        want = sum(w * expert(mlp, int(e), hidden[b, s]) for w, e in zip(weights, top.indices))
        torch.testing.assert_close(out[b, s], want, rtol=1e-5, atol=1e-6)


# Capacity ---------------------------------------------------------------------------------------

def test_capacity_keeps_first_choices_before_second_ones_and_earlier_positions_first():
    # two sequences, 5 positions, k = 2; capacity 2 per expert and sequence
    experts = torch.tensor([
        [[0, 1], [0, 2], [0, 1], [1, 0], [0, 3]],
        [[2, 3], [3, 2], [2, 3], [1, 2], [3, 0]],
    ])
    # sequence 0, expert 0's queue: the first choices of positions 0, 1 (kept), 2, 4 (dropped),
    # then position 3's second choice (dropped); expert 1's: position 3's first choice, then
    # the second choices of positions 0 (kept) and 2 (dropped); experts 2 and 3: one each.
    # sequence 1 starts its queues afresh: expert 2 takes the first choices of positions 0 and
    # 2, so every second choice of 2 is dropped; expert 3 takes position 1's and 4's first
    # choices, so the second choices of 3 (positions 0 and 2) are dropped.
    want = torch.tensor([
        [[1, 1], [1, 1], [0, 0], [1, 0], [0, 1]],
        [[1, 0], [1, 0], [1, 0], [1, 0], [1, 1]],
    ], dtype=torch.bool)
    assert torch.equal(capacity_keep(experts, E, 2), want)
    assert capacity_keep(experts, E, None).all()
    assert capacity_keep(experts, E, 5).all()


# [first, second] preferred expert of each position of the topk test: logits SHARP at the first,
# SHARP / 2 at the second, 0 elsewhere
CHOICES = [(0, 1), (0, 2), (0, 1), (1, 0), (0, 3)]


def preferences(choices):
    out = torch.zeros(len(choices), E)
    for s, (first, second) in enumerate(choices):
        out[s, first], out[s, second] = 1.0, 0.5
    return out


def test_switch_capacity_drops_later_tokens_with_zero_output():
    # five tokens, three of them for expert 0; factor 1: capacity ceil(1 x 1 x 5 / 4) = 2
    mlp = steer(layer(router_type="switch", expert_capacity_factor=1.0))
    prefs = torch.zeros(1, 5, E)
    for s, e in enumerate([0, 0, 0, 1, 2]):
        prefs[0, s, e] = 1.0
    hidden = tokens(prefs)
    mlp.train()
    out, _ = mlp(hidden)
    assert torch.equal(out[0, 2], torch.zeros(D_MODEL))  # the third token of expert 0
    top = math.exp(SHARP) / (math.exp(SHARP) + E - 1)  # the chosen expert's probability
    for s, e in [(0, 0), (1, 0), (3, 1), (4, 2)]:
        torch.testing.assert_close(out[0, s], top * expert(mlp, e, hidden[0, s]))
    assert (mlp.stats.calls, float(mlp.stats.dropped), mlp.stats.choices) == (1, 1.0, 5.0)
    assert mlp.stats.load.tolist() == [3, 1, 1, 0]  # before capacity


def test_topk_capacity_drops_choices_in_order_and_a_fully_dropped_token_outputs_zero():
    # k = 2, length 5, factor 0.6: capacity ceil(0.6 x 2 x 5 / 4) = 2 (see the capacity_keep
    # test for the queues); two equal sequences: each is queued on its own
    mlp = steer(layer(router_type="topk", router_topk=2, expert_capacity_factor=0.6))
    hidden = tokens(preferences(CHOICES).expand(2, -1, -1))
    mlp.train()
    out, _ = mlp(hidden)
    p_hi = math.exp(SHARP) / (math.exp(SHARP) + math.exp(SHARP / 2) + 2)
    p_lo = math.exp(SHARP / 2) / (math.exp(SHARP) + math.exp(SHARP / 2) + 2)
    w_first, w_second = p_hi / (p_hi + p_lo), p_lo / (p_hi + p_lo)
    for b in range(2):
        x = hidden[b]
        both = [w_first * expert(mlp, first, x[s]) + w_second * expert(mlp, second, x[s])
                for s, (first, second) in enumerate(CHOICES)]
        torch.testing.assert_close(out[b, 0], both[0])
        torch.testing.assert_close(out[b, 1], both[1])
        assert torch.equal(out[b, 2], torch.zeros(D_MODEL))  # both choices dropped
        # one choice dropped: the other keeps its weight (renormalised before capacity)
        torch.testing.assert_close(out[b, 3], w_first * expert(mlp, 1, x[3]))
        torch.testing.assert_close(out[b, 4], w_second * expert(mlp, 3, x[4]))
    stats = mlp.stats
    assert (stats.calls, float(stats.dropped), stats.choices) == (1, 2 * 4.0, 2 * 10.0)
    assert stats.load.tolist() == [2 * 5, 2 * 3, 2 * 1, 2 * 1]


@pytest.mark.parametrize("factor, router, length, want", [
    (1.0, "switch", 5, 2),     # 1.25
    (1.25, "topk", 8, 5),      # 1.25 x 2 x 8 / 4 = 5
    (0.6, "topk", 5, 2),       # 1.5
    (2.0, "switch", 6, 3),     # 3
    (0.1, "switch", 4, 1),     # 0.1: at least one
    (1.1, "topk", 100, 55),    # 55, which floating point writes 55.00000000000001
    (2.2, "switch", 100, 55),  # the same
])
def test_capacity_formula(factor, router, length, want):
    mlp = layer(router_type=router, router_topk=2, expert_capacity_factor=factor)
    assert mlp.train().capacity(length) == want


def test_capacity_without_a_factor_is_hugging_faces_expert_capacity_or_dropless():
    mlp = layer(expert_capacity=3)
    assert mlp.train().capacity(50) == 3 and mlp.eval().capacity(50) == 3
    mlp = layer()
    assert mlp.train().capacity(50) is None and mlp.eval().capacity(50) is None


def test_evaluation_takes_the_evaluation_capacity_factor():
    # eight tokens, all for expert 0: capacity 2 in training (factor 1), 4 in evaluation (2)
    mlp = steer(layer(expert_capacity_factor=1.0, eval_expert_capacity_factor=2.0))
    prefs = torch.zeros(1, 8, E)
    prefs[..., 0] = 1.0
    hidden = tokens(prefs)
    assert (mlp.train().capacity(8), mlp.eval().capacity(8)) == (2, 4)
    for training, kept in ((True, 2), (False, 4)):
        mlp.train(training)
        mlp.stats.reset()
        with torch.no_grad():
            out, _ = mlp(hidden)
        # the log's numbers count training forwards only (evaluation would mix into them)
        assert float(mlp.stats.dropped) == (8 - kept if training else 0)
        assert (out[0].abs().sum(-1) > 0).tolist() == [True] * kept + [False] * (8 - kept)
    # no evaluation factor and no expert_capacity: evaluation is dropless
    mlp = steer(layer(expert_capacity_factor=1.0))
    assert mlp.eval().capacity(8) is None
    with torch.no_grad():
        out, _ = mlp(hidden)
    assert bool((out[0].abs().sum(-1) > 0).all())


# Expert bias ------------------------------------------------------------------------------------

def test_update_expert_bias_moves_each_bias_by_the_rate_toward_the_mean_load():
    mlp = layer(moe_expert_bias=True)
    bias = mlp.router.expert_bias
    assert torch.equal(bias, torch.zeros(E))
    mlp.step_load = torch.tensor([5.0, 1.0, 3.0, 3.0], dtype=torch.float64)  # mean 3
    update_expert_bias(mlp, 0.01)
    # over the mean: down by the rate; under: up; at the mean: unchanged
    torch.testing.assert_close(bias, torch.tensor([-0.01, 0.01, 0.0, 0.0]))
    assert mlp.step_load is None
    mlp.step_load = torch.tensor([0.0, 4.0, 4.0, 4.0], dtype=torch.float64)  # mean 3
    update_expert_bias(mlp, 0.01)
    torch.testing.assert_close(bias, torch.tensor([0.0, 0.0, -0.01, -0.01]))
    update_expert_bias(mlp, 0.01)  # no step since: no load, no change
    torch.testing.assert_close(bias, torch.tensor([0.0, 0.0, -0.01, -0.01]))


def test_the_step_load_is_counted_in_training_forwards_only():
    mlp = steer(layer(moe_expert_bias=True, router_type="topk", router_topk=2))
    hidden = tokens(preferences(CHOICES)[None])
    mlp.train()
    mlp(hidden)
    mlp(hidden)
    mlp.eval()
    with torch.no_grad():
        mlp(hidden)
    assert mlp.step_load.tolist() == [2 * 5, 2 * 3, 2 * 1, 2 * 1]
    update_expert_bias(mlp, 0.5)  # mean 2.5
    assert mlp.router.expert_bias.tolist() == [-0.5, -0.5, 0.5, 0.5]


def test_expert_bias_changes_the_choice_but_not_the_gate_weights():
    probs = torch.tensor([[[0.5, 0.3, 0.2]]])
    bias = torch.tensor([0.0, 0.0, 0.4])  # biased scores: 0.5, 0.3, 0.6
    switch = route(probs.log(), "switch", 1, None, True, expert_bias=bias)
    assert switch.experts.tolist() == [[2]]
    torch.testing.assert_close(switch.weights, torch.tensor([[0.2]]))
    topk = route(probs.log(), "topk", 2, None, True, expert_bias=bias)
    assert topk.experts.tolist() == [[2, 0]]
    torch.testing.assert_close(topk.weights, torch.tensor([[0.2 / 0.7, 0.5 / 0.7]]))
    torch.testing.assert_close(topk.probs, probs)
    # in the layer: the bias sends a token to its second expert, at that expert's probability
    mlp = steer(layer(moe_expert_bias=True))
    with torch.no_grad():
        mlp.router.expert_bias.copy_(torch.tensor([0.0, 1.0, 0.0, 0.0]))
    prefs = torch.zeros(1, 1, E)
    prefs[0, 0, 0], prefs[0, 0, 1] = 1.0, 0.5
    hidden = tokens(prefs)
    out, _ = mlp(hidden)
    p_lo = math.exp(SHARP / 2) / (math.exp(SHARP) + math.exp(SHARP / 2) + 2)
    torch.testing.assert_close(out[0, 0], p_lo * expert(mlp, 1, hidden[0, 0]))


# Grouped multiply -------------------------------------------------------------------------------

def loop_linear(rows, weight, counts):
    """rows of group g times weight[g]^T, group by group."""
    parts = torch.split(rows, counts.tolist())
    out = [part @ weight[g].T for g, part in enumerate(parts)]
    return torch.cat(out) if out else rows.new_zeros(0, weight.shape[1])


COUNTS = [[2, 0, 3], [0, 0, 0], [5, 0, 0, 0], [0, 0, 4], [1, 1, 1, 1], [0, 3, 0, 1]]


@pytest.mark.parametrize("implementation", [grouped_linear, padded_grouped_linear])
@pytest.mark.parametrize("counts", COUNTS, ids=str)
def test_grouped_linear_equals_a_loop_over_experts(implementation, counts):
    counts = torch.tensor(counts)
    g = torch.Generator().manual_seed(sum(counts.tolist()))
    rows = torch.randn(int(counts.sum()), 8, generator=g, requires_grad=True)
    weight = torch.randn(len(counts), 12, 8, generator=g, requires_grad=True)
    out = implementation(rows, weight, counts)
    want = loop_linear(rows, weight, counts)
    torch.testing.assert_close(out, want)
    if rows.shape[0]:
        grad = torch.randn(want.shape, generator=g)
        got = torch.autograd.grad(out, (rows, weight), grad)
        expected = torch.autograd.grad(want, (rows, weight), grad)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("width, dtype", [(6, torch.float32), (8, torch.float64),
                                          (4, torch.bfloat16), (16, torch.bfloat16)])
def test_grouped_linear_takes_any_width_and_float_dtype(width, dtype):
    # grouped_mm wants rows of a multiple of 16 bytes and float32 / bfloat16 / float16
    counts = torch.tensor([3, 0, 2])
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(5, width, generator=g).to(dtype)
    weight = torch.randn(3, 10, width, generator=g).to(dtype)
    want = loop_linear(rows.double(), weight.double(), counts)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(grouped_linear(rows, weight, counts).double(), want,
                               rtol=tol, atol=tol * float(want.abs().max()))


# Balancing losses -------------------------------------------------------------------------------

def test_load_balancing_loss_by_hand():
    probs = torch.tensor([[[0.8, 0.2], [0.4, 0.6]],
                          [[0.9, 0.1], [0.7, 0.3]]])
    experts = torch.tensor([[[0], [1]], [[0], [0]]])
    # sequence 0: f = (1/2, 1/2), P = (0.6, 0.4): 2 x (0.3 + 0.2) = 1.0
    # sequence 1: f = (1, 0), P = (0.8, 0.2): 2 x 0.8 = 1.6; the mean: 1.3
    torch.testing.assert_close(load_balancing_loss(probs, experts), torch.tensor(1.3))
    # k = 2 of 3 experts, one sequence of two tokens: f_e is the fraction of tokens having e
    # among their choices: e0 both, e1 one, e2 one -> f = (1, 1/2, 1/2)
    probs = torch.tensor([[[0.5, 0.3, 0.2], [0.1, 0.3, 0.6]]])  # P = (0.3, 0.3, 0.4)
    experts = torch.tensor([[[0, 1], [2, 0]]])
    torch.testing.assert_close(load_balancing_loss(probs, experts),
                               torch.tensor(3 * (0.3 + 0.15 + 0.2)))


def test_router_z_loss_by_hand():
    logits = torch.tensor([[[0.0, 0.0], [math.log(3.0), 0.0]]])
    # logsumexp: log 2 and log 4 = 2 log 2; the mean of their squares: 2.5 (log 2)^2
    torch.testing.assert_close(router_z_loss(logits), torch.tensor(2.5 * math.log(2.0) ** 2))


# BASE -------------------------------------------------------------------------------------------

def test_base_gives_every_expert_the_same_number_of_a_sequences_tokens_in_training():
    logits = random_logits((3, 8, E), seed=4)
    logits[..., 0] += 5.0  # greedy would send nearly everything to expert 0
    routing = route(logits, "base", 1, None, training=True)
    chosen = routing.experts.reshape(3, 8)
    for b in range(3):
        assert torch.bincount(chosen[b], minlength=E).tolist() == [2] * E
    torch.testing.assert_close(routing.weights, torch.sigmoid(
        logits.reshape(24, E).gather(-1, routing.experts)))


def test_base_assignment_maximises_the_total_score():
    # four tokens, two experts, two tokens each: the best of the six balanced assignments
    # (greedy would send all four to expert 0)
    logits = torch.tensor([[[4.0, 1.0], [3.0, 2.5], [2.0, 0.0], [5.0, 3.5]]])
    best = max((sum(float(logits[0, s, e]) for s, e in enumerate(a)), a)
               for a in itertools.product(range(2), repeat=4) if sum(a) == 2)
    # by hand: from all on expert 0 (14), expert 1 takes the two tokens that lose least by
    # moving, 1 and 3 (0.5 and 1.5; tokens 0 and 2 lose 3 and 2): 12
    assert best == (12.0, (0, 1, 0, 1))
    routing = route(logits, "base", 1, None, training=True)
    assert tuple(routing.experts[:, 0].tolist()) == best[1]


def test_base_is_greedy_in_evaluation_with_sigmoid_weights():
    logits = random_logits((2, 6, E), seed=5)
    logits[..., 0] += 5.0
    routing = route(logits, "base", 1, None, training=False)
    flat = logits.reshape(12, E)
    assert torch.equal(routing.experts[:, 0], flat.argmax(-1))
    torch.testing.assert_close(routing.weights[:, 0], torch.sigmoid(flat.max(-1).values))


def test_base_layer_adds_no_balancing_loss():
    mlp = layer(router_type="base").train()
    out, aux = mlp(torch.randn(2, 8, D_MODEL))
    assert aux is None
    assert float(mlp.stats.dropped) == 0 and mlp.stats.load.tolist() == [4] * E


# Statistics under activation checkpointing --------------------------------------------------------

def test_a_checkpointed_forward_counts_its_tokens_once():
    fields = dict(router_type="topk", router_topk=2, expert_capacity_factor=0.6,
                  moe_expert_bias=True)
    hidden = tokens(preferences(CHOICES).expand(2, -1, -1))
    plain = steer(layer(**fields)).train()
    out, aux = plain(hidden.clone().requires_grad_())
    (out.square().sum() + aux).backward()

    mlp = steer(layer(**fields)).train()
    runs = []

    def run(h):
        runs.append(1)
        return mlp(h)

    out_c, aux_c = checkpoint(run, hidden.clone().requires_grad_())
    (out_c.square().sum() + aux_c).backward()
    assert len(runs) == 2  # the forward, and its recomputation in backward
    for name in ("calls", "dropped", "choices"):
        assert float(getattr(mlp.stats, name)) == float(getattr(plain.stats, name)), name
    assert (mlp.stats.calls, float(mlp.stats.dropped)) == (1, 8.0)  # the topk capacity test
    assert torch.equal(mlp.stats.load, plain.stats.load)
    assert torch.equal(mlp.step_load, plain.step_load)
    for (name, p), q in zip(mlp.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_base_routing_ignores_a_folders_expert_capacity():
    """Hugging Face configs always carry expert_capacity; BASE is balanced and drops nothing."""
    from megatron.model import T5Config
    from megatron.model.moe import SparseMLP
    from megatron.model.transformer import InitMethods
    from megatron.tensor_parallel.group import NO_EXPERT_PARALLEL, SINGLE

    config = T5Config(vocab_size=50, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2,
                      num_experts=2, router_type="base", expert_capacity=1, dropout_rate=0.0)
    layer = SparseMLP(config, InitMethods(config, 1), tp=SINGLE, ep=NO_EXPERT_PARALLEL,
                      sparse_layers=1)
    layer.train()
    layer(torch.randn(2, 8, 8))
    assert layer.capacity(8) is None
    assert float(layer.stats.dropped) == 0.0 and layer.stats.choices == 16
