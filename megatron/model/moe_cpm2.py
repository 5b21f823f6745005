"""CPM-2-MoE's BASE layers: the 'cpm2' router, as CPM-2-Pretrain's `moe` branch computes them.

What CPM-2 does (its src/mpu/baselayer.py, src/pretrain_enc_dec.py, init_ckpt.py), on W
data-parallel ranks with one expert each, every feed-forward sublayer replaced:
1. the shuffle: each rank rotates its N tokens by rank x N / W and sends the i-th N / W of them to
   rank i (an all-to-all of equal parts), to break correlations within a batch;
2. the scores: `layer_norm(x) @ centroids.T` under no_grad, with `centroids` a [W, d_model]
   tensor initialised `orthogonal_(gain=0.1)` (init_ckpt.py: 0.01) that never receives a gradient,
   so it is never updated: a random projection used as a locality-sensitive hash;
3. the assignment: CPM-2's auction (libbase, `cpm2_assignment`) splits each rank's N tokens into
   W equal shares, one per expert; the shares go to the experts by an all-to-all and back;
4. the expert is the whole sublayer x + FFN(layer_norm(x)); its output is not scaled by a gate
   (where tied scores make the auction list a token twice, `repair_assignment` differs from
   CPM-2, which would return uninitialised rows);
5. all of it in evaluation too (their `is_training` is always true).
Decoding (megatron/generation) asks for test-time routing instead (`test_time_routing=True` in
the forward, in evaluation mode): each token to the expert of its best score, no shuffle and no balancing, as the BASE layers paper does at test time
and as fairseq's BaseLayer (`greedy_assignment` when not training, the code CPM-2 started from,
kept but unused in CPM-2's branch) computes it: a decoding step has batch x 1 tokens, no multiple
of E x E / EP, and an input's output must not depend on the other inputs of its batch.
The expert's layer norm is one per block here: CPM-2 keeps a copy in every expert, but trains it
as a shared weight (its optimizer marks `expert_network` parameters other than the layer norm as
experts; the rest have their gradients averaged over the data-parallel ranks), so the copies stay
equal, and scoring with "the expert's" layer norm is scoring with the block's. Computing the
norm before the all-to-all instead of after it gives the same numbers (it is per token), and so
does adding the residual after the way back.

Layouts. The routing pool is the data-parallel group: the expert-parallel group must be the
whole data-parallel group (EP = DP; the trainer refuses the rest, megatron/model/settings.py).
With E experts on EP ranks each rank holds E / EP experts and stands for E / EP of CPM-2's
ranks ("virtual ranks"): its tokens are cut into E / EP equal consecutive parts, each shuffled
and assigned as one CPM-2 rank's. So E = EP is CPM-2's layout exactly, and one process with E
experts computes what E ranks compute on its tokens split in E (the reference the tests compare
every layout to). Tensor parallelism splits each expert's d_ff as in the dense model; pipeline
stages hold whole blocks. Every rank's tokens (micro-batch x length) must be a multiple of
E x E / EP: each virtual rank's tokens split into E shuffle chunks.
"""

from __future__ import annotations

from typing import List

import torch
from torch import nn

from megatron.model.balanced_assignment import cpm2_assignment
from megatron.model.moe import Routing, SparseMLP, _AllToAll
from megatron.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from megatron.tensor_parallel.random import is_recomputing


class CentroidRouter(nn.Module):
    """The frozen centroids (`expert_centroids`, CPM-2's name: [experts, d_model]), a buffer: saved
    with the model, never given a gradient or optimizer state. The same on every rank."""

    expert_bias = None  # (no auxiliary-loss-free bias: the assignment is balanced)

    def __init__(self, config, device=None, dtype=None) -> None:
        super().__init__()
        shape = (config.num_experts, config.d_model)
        self.register_buffer("expert_centroids", torch.empty(shape, device=device, dtype=dtype))
        if self.expert_centroids.device.type != "meta":
            master = torch.empty(shape, dtype=torch.float32)
            nn.init.orthogonal_(master, gain=config.router_centroid_gain)
            with torch.no_grad():
                self.expert_centroids.copy_(master)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """[..., d_model] normalised tokens -> [..., experts] scores, in the tokens' dtype."""
        return tokens.matmul(self.expert_centroids.to(tokens.dtype).transpose(0, 1))


def token_multiple(num_experts: int, expert_parallel_size: int) -> int:
    """The number every rank's token count (micro-batch x length) must be a multiple of."""
    return num_experts * (num_experts // expert_parallel_size)


def repair_assignment(order: torch.Tensor) -> torch.Tensor:
    """CPM-2's auction can list a token twice and miss another where scores tie exactly (its
    loop ends when every token has a bid, but it returns each expert's last selection, which can
    overlap): CPM-2 then runs the twice-listed token twice and gives the missed one uninitialised
    rows. Here each token keeps its first slot and the repeated slots go to the missed tokens in
    index order, so every expert keeps its equal share. [groups, tokens] -> the same (`order`
    itself when every row is a permutation, the usual case)."""
    tokens = order.shape[1]
    counts = torch.zeros_like(order).scatter_add_(1, order, torch.ones_like(order))
    if bool((counts == 1).all()):
        return order
    fixed = order.clone()
    for row, count in zip(fixed, counts):
        missed = (count == 0).nonzero().flatten().tolist()
        seen = torch.zeros(tokens, dtype=torch.bool)
        for slot, token in enumerate(row.tolist()):
            if seen[token]:
                row[slot] = missed.pop(0)
            seen[token] = True
    return fixed


class CPM2SparseMLP(SparseMLP):
    """The Mixture-of-Experts feed-forward of router type 'cpm2' (module docstring); the experts,
    statistics and named ranges are SparseMLP's. forward(normalised hidden, test_time_routing)
    -> (FFN output, None); with test_time_routing, in evaluation mode only, each token goes to
    its best-scoring expert (module docstring)."""

    def make_router(self, config, init, device, dtype) -> nn.Module:
        return CentroidRouter(config, device, dtype)

    def capacity(self, length: int):
        return None

    def forward_flops(self, tokens: int) -> int:
        experts = self.experts
        per_token = 2 * experts.d_model * experts.d_ff * (3 if experts.gated else 2)
        return tokens * (2 * experts.d_model * self.num_experts + per_token)

    def forward(self, hidden: torch.Tensor, test_time_routing: bool = False):
        if test_time_routing and not self.training:
            return self._greedy(hidden), None
        batch, length, width = hidden.shape
        tokens = copy_to_tensor_model_parallel_region(hidden.reshape(-1, width), self.tp)
        count = tokens.shape[0]
        experts, local, ranks = self.num_experts, self.experts.local, self.ep.size
        multiple = token_multiple(experts, ranks)
        if count % multiple:
            raise ValueError(
                f"router type 'cpm2': a rank's {count} tokens (micro-batch {batch} x length "
                f"{length}) are not a multiple of experts x local experts = {multiple}: CPM-2's "
                "shuffle and assignment split each rank's tokens into equal parts")
        share = count // local  # a virtual rank's tokens
        chunk = share // experts
        # 1. the shuffle: virtual rank v = rank x local + j rotates its share by v x chunk
        first = self.ep.rank * local
        rotated = torch.stack([
            torch.roll(torch.arange(j * share, (j + 1) * share, device=tokens.device),
                       -(first + j) * chunk) for j in range(local)])  # [j, share]
        # to rank q: [its virtual u][our virtual j][chunk] (CPM-2: equal parts in rank order)
        send = rotated.view(local, ranks, local, chunk).permute(1, 2, 0, 3).reshape(-1)
        arrived = self._all_to_all(tokens[send])  # [source rank][our j'][its j][chunk]
        pools = arrived.view(ranks, local, local, chunk, width).permute(1, 0, 2, 3, 4) \
            .reshape(local, share, width)  # per virtual rank: chunks in CPM-2's rank order
        # 2.-3. scores and CPM-2's assignment, per pool: share / experts tokens per expert
        scores = self.router(pools)
        order = repair_assignment(cpm2_assignment(scores))  # [local, share], by expert
        routed = torch.gather(pools, 1, order[..., None].expand(-1, -1, width))
        # to the experts: rank q gets [our pool j'][its local expert l][chunk]
        routed = routed.view(local, ranks, local, chunk, width).permute(1, 0, 2, 3, 4)
        received = self._all_to_all(routed.reshape(-1, width))  # [source][pool][l][chunk]
        rows = received.view(ranks, local, local, chunk, width).permute(2, 0, 1, 3, 4) \
            .reshape(-1, width)  # by local expert, then source virtual rank
        counts = torch.full((local,), ranks * local * chunk, dtype=torch.long,
                            device=tokens.device)
        out = reduce_from_tensor_model_parallel_region(self.experts(rows, counts), self.tp)
        # 4. back: the reverse of every step
        out = out.view(local, ranks, local, chunk, width).permute(1, 2, 0, 3, 4).reshape(-1, width)
        back = self._all_to_all(out).view(ranks, local, local, chunk, width) \
            .permute(1, 0, 2, 3, 4).reshape(local, share, width)  # [pool][expert-major]
        pooled = torch.empty_like(back).scatter(
            1, order[..., None].expand(-1, -1, width), back)  # the pools' own order
        returned = pooled.view(local, ranks, local, chunk, width).permute(1, 0, 2, 3, 4)
        mine = self._all_to_all(returned.reshape(-1, width))  # [rank q][its u][our j][chunk]
        result = torch.empty_like(tokens).index_copy(0, send, mine)
        if self.training and not is_recomputing():
            load = torch.full((experts,), float(count // experts), dtype=torch.float64)
            self.stats.add(0.0, 0.0, torch.zeros((), dtype=torch.float64), float(count), load)
        return result.reshape(batch, length, width), None

    def _greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """Each token through the expert of its best score (ties: the lower index), its output
        not scaled; any number of tokens, any expert-parallel size (SparseMLP's exchange)."""
        batch, length, width = hidden.shape
        tokens = hidden.reshape(-1, width)
        scores = self.router(tokens).float()
        chosen = scores.argmax(dim=-1, keepdim=True)
        routing = Routing(chosen, torch.ones_like(chosen, dtype=torch.float32),
                          torch.ones_like(chosen, dtype=torch.bool), None, scores)
        return self._experts(tokens, routing).reshape(batch, length, width)

    def _all_to_all(self, rows: torch.Tensor) -> torch.Tensor:
        """Equal parts to every expert-parallel rank (nothing to send with one)."""
        if self.ep.size == 1:
            return rows
        parts: List[int] = [rows.shape[0] // self.ep.size] * self.ep.size
        return _AllToAll.apply(rows, parts, parts, self.ep.group, self.ranges)
