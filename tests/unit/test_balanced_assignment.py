"""The balanced assignment of BASE layers (csrc/balanced_assignment.cpp) against scipy.

Every case checks the balance (no expert over capacity, exactly tokens / experts each when the
default capacity divides) and that the total score equals the optimum that
`scipy.optimize.linear_sum_assignment` finds on the same problem expanded to experts * capacity
slots, within 1e-6 of the score range.
"""

import numpy as np
import pytest
import torch
from scipy.optimize import linear_sum_assignment

from megatron.model import _moe_helpers
from megatron.model.balanced_assignment import balanced_assignment


def optimum(scores: np.ndarray, capacity: int) -> float:
    """scipy's best total for one group, scores [tokens, experts]."""
    slots = np.repeat(scores.astype(np.float64), capacity, axis=1)  # [tokens, experts * capacity]
    rows, cols = linear_sum_assignment(slots, maximize=True)
    return float(slots[rows, cols].sum())


def check(scores: np.ndarray, capacity=None, abs_tol=None) -> torch.Tensor:
    """Runs the assignment on float32 `scores` [groups, tokens, experts] and checks it: balanced,
    and optimal within `abs_tol` (default 1e-6 of each group's score range)."""
    groups, tokens, experts = scores.shape
    expert = balanced_assignment(torch.from_numpy(scores), capacity)
    assert expert.dtype == torch.int64 and expert.shape == (groups, tokens)
    cap = capacity if capacity is not None else -(-tokens // experts)
    for g in range(groups):
        chosen = expert[g].numpy()
        assert chosen.min() >= 0 and chosen.max() < experts
        count = np.bincount(chosen, minlength=experts)
        assert count.max() <= cap, count
        if capacity is None and tokens % experts == 0:
            assert (count == tokens // experts).all(), count
        total = float(scores[g, np.arange(tokens), chosen].astype(np.float64).sum())
        best = optimum(scores[g], min(cap, tokens))
        score_range = float(scores[g].max()) - float(scores[g].min())
        tol = abs_tol if abs_tol is not None else 1e-6 * score_range + 1e-300
        assert total == pytest.approx(best, rel=0, abs=tol), (g, total, best)
    return expert


def normal(rng, shape, scale=1.0, shift=0.0):
    return (rng.standard_normal(shape) * scale + shift).astype(np.float32)


# ------------------------------------------------------------------------------------------------
# Shapes


@pytest.mark.parametrize("groups, tokens, experts, capacity", [
    (3, 64, 8, None),     # tokens == experts * capacity
    (2, 512, 32, None),   # the benchmark's shape, 16 tokens per expert
    (2, 60, 8, 8),        # 4 spare slots
    (4, 114, 32, None),   # a decoder's 114 tokens on 32 experts (capacity 4, 14 spare slots)
    (2, 50, 8, 20),       # capacity well above the balanced one
    (3, 17, 1, None),     # one expert takes everything
    (2, 200, 200, None),  # many experts, one token each: a plain assignment problem
    (2, 300, 150, None),
    (2, 10, 64, None),    # more experts than tokens
])
def test_random_scores(groups, tokens, experts, capacity):
    rng = np.random.default_rng(tokens * 1000 + experts)
    check(normal(rng, (groups, tokens, experts)), capacity)


def test_many_small_random_problems():
    rng = np.random.default_rng(7)
    for _ in range(300):
        experts, capacity = int(rng.integers(1, 9)), int(rng.integers(1, 6))
        tokens = int(rng.integers(1, experts * capacity + 1))
        check(normal(rng, (1, tokens, experts)), capacity)


# ------------------------------------------------------------------------------------------------
# Values


def test_ties():
    rng = np.random.default_rng(1)
    check(rng.integers(0, 3, (4, 64, 8)).astype(np.float32))         # three values: many ties
    check(rng.integers(0, 2, (4, 50, 8)).astype(np.float32), 7)


def test_equal_scores():
    scores = np.full((2, 64, 8), -3.5, np.float32)
    expert = check(scores)
    assert (np.bincount(expert[0].numpy(), minlength=8) == 8).all()
    check(np.zeros((1, 30, 7), np.float32), 5)
    check(np.ones((1, 1, 1), np.float32))


@pytest.mark.parametrize("scale, shift", [
    (1.0, -50.0),    # all negative
    (1e30, 0.0),     # large magnitude
    (1e-30, -1e-29), # tiny magnitude
    (1.0, 1e6),      # a large offset: the gaps are 1e-7 of the values
])
def test_magnitudes(scale, shift):
    check(normal(np.random.default_rng(2), (3, 64, 8), scale, shift))


def test_one_huge_outlier():
    # The other scores are about 1e-8 of the range apart, below what the auction's last epsilon
    # resolves (1e-7 / slots of the range): the final cycle cancelling must still find the optimum
    # of the small scores, not only come within 1e-6 of the range (100 here).
    # (Without the cancelling these groups end 0.05 to 0.16 below it.)
    scores = normal(np.random.default_rng(2), (3, 64, 8))
    scores[:, 0, 0] = 1e8
    check(scores, abs_tol=1e-3)


def test_log_probabilities():
    # What a router gives: log-softmax scores, most tokens preferring a few experts.
    logits = torch.randn(4, 256, 16, generator=torch.Generator().manual_seed(4)) * 3
    logits[..., :3] += 2
    check(torch.log_softmax(logits, dim=-1).numpy())


def test_groups_are_independent():
    rng = np.random.default_rng(5)
    scores = np.stack([normal(rng, (96, 12)), rng.integers(0, 2, (96, 12)).astype(np.float32),
                       normal(rng, (96, 12), 1e20), np.zeros((96, 12), np.float32)])
    together = check(scores)
    for g in range(len(scores)):
        assert torch.equal(balanced_assignment(torch.from_numpy(scores[g:g + 1]))[0], together[g])


def test_hand_computed():
    # Capacity 2. Token 0 likes expert 0 best of all, but tokens 1 and 2 would lose more on
    # expert 1 (gains of expert 0 over 1: 1, 3, 2, -2), so token 0 yields: 4 + 4 + 3 + 2 = 13,
    # where greedy top-1 would put three tokens on expert 0.
    scores = torch.tensor([[[5.0, 4.0], [4.0, 1.0], [3.0, 1.0], [0.0, 2.0]]])
    assert balanced_assignment(scores).tolist() == [[1, 0, 0, 1]]
    assert balanced_assignment(scores, capacity=3).tolist() == [[0, 0, 0, 1]]


# ------------------------------------------------------------------------------------------------
# The Python entry


def test_dtypes_and_autograd():
    scores = torch.randn(2, 32, 4, generator=torch.Generator().manual_seed(6), requires_grad=True)
    reference = balanced_assignment(scores)
    assert reference.device == scores.device
    assert torch.equal(balanced_assignment(scores.double()), reference)
    halved = balanced_assignment(scores.to(torch.bfloat16))
    assert halved.dtype == torch.int64
    check(scores.detach().to(torch.bfloat16).float().numpy())
    strided = scores.transpose(1, 2).contiguous().transpose(1, 2)  # same values, not contiguous
    assert torch.equal(balanced_assignment(strided), reference)


def test_empty():
    assert balanced_assignment(torch.zeros(3, 0, 4)).shape == (3, 0)
    assert balanced_assignment(torch.zeros(0, 5, 4)).shape == (0, 5)
    assert balanced_assignment(torch.zeros(2, 0, 0)).shape == (2, 0)


def test_too_few_slots():
    scores = torch.zeros(1, 100, 8)
    with pytest.raises(ValueError, match=r"100 tokens do not fit in 8 experts x capacity 12 = 96 "
                                         r"slots: the capacity must be at least .* = 13"):
        balanced_assignment(scores, capacity=12)
    with pytest.raises(ValueError, match="3 tokens cannot be assigned to 0 experts"):
        balanced_assignment(torch.zeros(1, 3, 0))


def test_non_finite_scores():
    scores = torch.zeros(2, 6, 4)
    scores[1, 2, 3] = float("nan")
    with pytest.raises(ValueError, match=r"scores\[1, 2, 3\] = nan: scores must be finite"):
        balanced_assignment(scores)
    scores[1, 2, 3] = float("-inf")
    with pytest.raises(ValueError, match=r"scores\[1, 2, 3\] = -inf"):
        balanced_assignment(scores)


def test_bad_arguments():
    with pytest.raises(ValueError, match="capacity.*must be >= 1, got 0"):
        balanced_assignment(torch.zeros(1, 4, 2), capacity=0)
    with pytest.raises(TypeError):
        balanced_assignment(torch.zeros(1, 4, 2), capacity=2.5)
    with pytest.raises(ValueError, match=r"\[groups, tokens, experts\], got shape \(4, 2\)"):
        balanced_assignment(torch.zeros(4, 2))
    with pytest.raises(ValueError, match="floating point"):
        balanced_assignment(torch.zeros(1, 4, 2, dtype=torch.int64))


def test_extension_checks_its_array():
    with pytest.raises(ValueError, match="dtype float32"):
        _moe_helpers.balanced_assignment(np.zeros((1, 4, 2)), 2)
    with pytest.raises(ValueError, match="C-contiguous"):
        _moe_helpers.balanced_assignment(np.zeros((1, 2, 4), np.float32).transpose(0, 2, 1), 2)
    with pytest.raises(ValueError, match="3-D"):
        _moe_helpers.balanced_assignment(np.zeros((4, 2), np.float32), 2)
