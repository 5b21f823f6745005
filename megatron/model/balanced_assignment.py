"""Balanced assignment of tokens to experts: the routing of BASE layers (Lewis et al., 2021).

At training time a BASE layer sends every token to one expert so that all experts get the same
number of tokens and the total token-expert affinity is as large as possible (fairseq's
`BaseLayer`, copied by CPM-2-MoE). At evaluation the balance is not needed and the greedy top-1
expert is taken instead; that is done by the router, not here.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch

import megatron.model._moe_helpers as _moe_helpers  # the C++ extension alone (not the package)


def balanced_assignment(scores: torch.Tensor, capacity: Optional[int] = None) -> torch.Tensor:
    """The expert of every token, at most `capacity` tokens per expert, maximising the total score.

    For each group g independently, returns expert[g, t] maximising
    sum_t scores[g, t, expert[g, t]] under: every token gets exactly one expert, and no expert gets
    more than `capacity` tokens. With the default capacity ceil(tokens / experts) the experts get
    tokens // experts or one more (exactly tokens / experts each when it divides).

    It is solved exactly (up to rounding: gains below 1e-12 of the group's score range are not
    pursued) by Bertsekas' auction with epsilon scaling in C++
    (`csrc/balanced_assignment.cpp`), the tokens bidding for experts * capacity slots, finished by
    a check that no cycle of token moves improves the total. Each scaling phase costs about
    O(tokens * (experts + capacity)) per group (a handful of bids per token), the check
    O(tokens * experts + experts^2), memory O(experts^2). 8 groups of 512 tokens on 32 experts
    take about 9 ms on one CPU core, 5-8x less than scipy's `linear_sum_assignment`; 8 groups of
    114 tokens about 1.5 ms, on par with it (bench/RESULTS.md). The groups run one after the
    other, without the GIL.

    Args:
        scores: [groups, tokens, experts] token-expert affinities, any float dtype, any device.
            They are detached and copied to the CPU as float32; larger scores are preferred.
        capacity: the most tokens an expert may take; default ceil(tokens / experts).

    Returns:
        LongTensor [groups, tokens] of expert indices, on the device of `scores`.

    Raises:
        ValueError: `scores` is not 3-D, holds NaN or infinite values, `capacity` < 1, or
            tokens > experts * capacity (not every token would get a slot).
        TypeError: `capacity` is not an integer.
    """
    if scores.dim() != 3:
        raise ValueError(f"balanced_assignment: scores must be [groups, tokens, experts], got "
                         f"shape {tuple(scores.shape)}")
    if not scores.is_floating_point():
        raise ValueError(f"balanced_assignment: scores must be floating point, got {scores.dtype}")
    _, tokens, experts = scores.shape
    if capacity is None:
        capacity = max(1, -(-tokens // experts)) if experts > 0 else 1
    capacity = operator.index(capacity)
    array = scores.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy()
    expert = _moe_helpers.balanced_assignment(array, capacity)  # int64 [groups, tokens]
    return torch.from_numpy(expert).to(scores.device)


def cpm2_assignment(scores: torch.Tensor) -> torch.Tensor:
    """CPM-2-MoE's balanced assignment (its src/libbase: fairseq's BASE-layer auction), the same
    answer bit for bit: for each group, T / E tokens per expert, listed expert by expert.

    Unlike `balanced_assignment` this is not the best assignment: CPM-2's auction bids with a
    fixed epsilon of 1/50 of the score range (at least 1e-4) and stops at the first round in
    which every token has a bidder (`csrc/cpm2_auction.cpp` follows their torch operations step
    for step, ties included). Non-finite scores are replaced by the smallest finite score of the
    group, as CPM-2 does.

    Args:
        scores: [groups, tokens, experts] token-expert affinities (any float dtype, any device;
            the auction runs on the CPU in float32), tokens a positive multiple of experts.

    Returns:
        LongTensor [groups, tokens] on the device of `scores`: row g holds the token indices of
        group g, entries e * T/E ... (e + 1) * T/E - 1 going to expert e.

    Raises:
        ValueError: `scores` is not 3-D, or tokens is not a positive multiple of experts, or a
            group has no finite score.
    """
    if scores.dim() != 3:
        raise ValueError(f"cpm2_assignment: scores must be [groups, tokens, experts], got shape "
                         f"{tuple(scores.shape)}")
    array = scores.detach().to(device="cpu", dtype=torch.float32)
    finite = array.isfinite()
    if not finite.all():
        array = array.clone()  # (not the caller's scores)
        finite = array.isfinite()
        for group, ok in zip(array, finite):
            if not ok.any():
                raise ValueError("cpm2_assignment: a group holds no finite score")
            group[~ok] = group[ok].min()
    order = _moe_helpers.cpm2_auction(array.contiguous().numpy())
    return torch.from_numpy(order).to(scores.device)
