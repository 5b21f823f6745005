"""Mixture-of-Experts feed-forward: a router, the experts as grouped weights, expert parallelism.

The layer (`SparseMLP`) replaces the dense feed-forward (`T5DenseActDense`) of the blocks the
config makes sparse (`T5Config.sparse_blocks`). Names follow Hugging Face's SwitchTransformers
(`mlp.router.classifier`, `mlp.experts`), the experts' weights stacked: `experts.wi`
[experts, d_ff, d_model] (`wi_0`, `wi_1` when gated) and `experts.wo` [experts, d_model, d_ff],
so that expert e is Hugging Face's `experts.expert_{e}.wi` / `.wo`.

- `route` routes in float32, per sequence ('switch', 'topk', 'base'), and keeps at most the
  capacity C = ceil(factor x k x length / experts) of a sequence's token choices per expert
  (dropless when no capacity is set); a dropped choice contributes zero and is counted.
- `load_balancing_loss` and `router_z_loss` are Switch's and ST-MoE's balancing losses (not for
  'base'), carried to the objective; `update_expert_bias` moves the auxiliary-loss-free bias.
- `Experts` is one grouped matrix multiply over the local experts, d_ff split over the
  tensor-parallel ranks; with `ExpertParallel` the token choices go to their expert's rank and
  back by all-to-all.

See docs/model-and-moe.md.
"""

from __future__ import annotations

import contextlib
import math
from fractions import Fraction
from typing import List, NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron.model.balanced_assignment import balanced_assignment
from megatron.model.config import T5Config
from megatron.model.dropout import dropout
from megatron.model.nonlinearity import activation_function
from megatron.tensor_parallel.group import ExpertParallel, TensorParallel
from megatron.tensor_parallel.layers import (divide, host_fp32,
                                             set_tensor_model_parallel_attributes, shard)
from megatron.tensor_parallel.random import get_cuda_rng_tracker, is_recomputing
from megatron.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)

ROUTER_TYPES = ("switch", "topk", "base")
"""The routers of this module ('cpm2': megatron/model/moe_cpm2.py)."""


class Routing(NamedTuple):
    """A batch's routing: T = batch x length tokens, k choices each."""

    experts: torch.Tensor
    """[T, k] int64: each choice's expert."""
    weights: torch.Tensor
    """[T, k] float32: the gate weight of each choice (0 where dropped)."""
    kept: torch.Tensor
    """[T, k] bool: the choice is within its expert's capacity."""
    probs: torch.Tensor
    """[B, S, E] float32: the router's probabilities."""
    logits: torch.Tensor
    """[B, S, E] float32: the router's logits."""


def capacity_keep(experts: torch.Tensor, num_experts: int, capacity: Optional[int]) -> torch.Tensor:
    """[B, S, k] choices -> [B, S, k] bool: the choices within `capacity` per expert and sequence,
    first choices before second ones, earlier positions first (None: all)."""
    if capacity is None:
        return torch.ones_like(experts, dtype=torch.bool)
    batch, length, k = experts.shape
    order = experts.transpose(1, 2).reshape(batch, k * length)  # (choice, position) order
    onehot = F.one_hot(order, num_experts)
    position = (onehot.cumsum(dim=1) * onehot).sum(-1)  # 1-based place in its expert's queue
    return (position <= capacity).reshape(batch, k, length).transpose(1, 2)


def route(logits: torch.Tensor, router_type: str, k: int, capacity: Optional[int],
          training: bool, expert_bias: Optional[torch.Tensor] = None) -> Routing:
    """The routing of [B, S, E] float32 logits (module docstring)."""
    batch, length, num_experts = logits.shape
    probs = logits.softmax(dim=-1)
    if router_type == "base":
        if training:
            chosen = balanced_assignment(logits.detach())[..., None].to(logits.device)
        else:
            chosen = logits.argmax(dim=-1, keepdim=True)
        weights = torch.sigmoid(logits.gather(-1, chosen))
    else:
        scores = probs if expert_bias is None else probs + expert_bias.float()
        chosen = scores.detach().topk(1 if router_type == "switch" else k, dim=-1).indices
        weights = probs.gather(-1, chosen)
        if router_type == "topk":
            weights = weights / weights.sum(dim=-1, keepdim=True)
    kept = capacity_keep(chosen, num_experts, capacity)
    weights = weights * kept
    return Routing(chosen.reshape(batch * length, -1), weights.reshape(batch * length, -1),
                   kept.reshape(batch * length, -1), probs, logits)


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Switch's auxiliary loss, per sequence, averaged over the batch: E x sum_e f_e P_e, f_e the
    fraction of tokens choosing e among their choices, P_e the mean probability of e.
    probs: [B, S, E]; experts: [B, S, k]."""
    num_experts = probs.shape[-1]
    chosen = F.one_hot(experts, num_experts).amax(dim=-2).float()  # [B, S, E]
    return num_experts * (chosen.mean(dim=1) * probs.mean(dim=1)).sum(-1).mean()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's z-loss: the mean over tokens of logsumexp(logits)^2."""
    return torch.logsumexp(logits, dim=-1).square().mean()


ALL_TO_ALL = "comm:all-to-all"
"""The named range around each all-to-all (megatron/training/profiling.py's ALL_TO_ALL)."""


def _no_range(name: str, nbytes: int = 0):
    return contextlib.nullcontext()


class _AllToAll(torch.autograd.Function):
    """all_to_all_single of rows with uneven splits; the backward sends the gradients back.
    `ranges`: the layer's named ranges (each call in ALL_TO_ALL, with its input's bytes)."""

    @staticmethod
    def forward(ctx, rows, send: List[int], receive: List[int], group, ranges):
        ctx.send, ctx.receive, ctx.group, ctx.ranges = send, receive, group, ranges
        out = rows.new_empty((sum(receive),) + tuple(rows.shape[1:]))
        rows = rows.contiguous()
        with ranges(ALL_TO_ALL, rows.numel() * rows.element_size()):
            dist.all_to_all_single(out, rows, receive, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty((sum(ctx.send),) + tuple(grad.shape[1:]))
        grad = grad.contiguous()
        with ctx.ranges(ALL_TO_ALL, grad.numel() * grad.element_size()):
            dist.all_to_all_single(back, grad, ctx.send, ctx.receive, group=ctx.group)
        return back, None, None, None, None


def grouped_linear(rows: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """rows [N, in] sorted by group, `counts` [G] rows per group; weight [G, out, in]:
    rows of group g times weight[g]^T, [N, out] (module docstring: grouped_mm, or a padded
    batched multiply where its kernels do not run)."""
    if _grouped_mm_runs(rows):
        offsets = counts.cumsum(0).to(torch.int32)
        return F.grouped_mm(rows, weight.transpose(1, 2), offs=offsets)
    return padded_grouped_linear(rows, weight, counts)


def _grouped_mm_runs(rows: torch.Tensor) -> bool:
    """Whether grouped_mm has a kernel for these rows: on CPU float32, bfloat16 or float16, on
    CUDA bfloat16; rows of a multiple of 16 bytes (it refuses other strides)."""
    dtypes = (torch.bfloat16,) if rows.device.type == "cuda" else \
        (torch.float32, torch.bfloat16, torch.float16)
    return rows.dtype in dtypes and rows.shape[1] * rows.element_size() % 16 == 0


def padded_grouped_linear(rows: torch.Tensor, weight: torch.Tensor,
                          counts: torch.Tensor) -> torch.Tensor:
    """grouped_linear as one batched multiply, each group's rows padded to the largest group's
    count."""
    groups = weight.shape[0]
    starts = counts.cumsum(0) - counts
    group = torch.repeat_interleave(torch.arange(groups, device=rows.device), counts)
    slot = torch.arange(rows.shape[0], device=rows.device) - starts[group]
    padded = rows.new_zeros(groups, int(counts.max()) if rows.shape[0] else 0, rows.shape[1])
    padded[group, slot] = rows
    return torch.bmm(padded, weight.transpose(1, 2))[group, slot]


class Experts(nn.Module):
    """This rank's experts: the dense feed-forward's weights stacked, [local experts, ...], each
    split over the tensor-parallel ranks like `T5DenseActDense` (wi by rows, wo by columns)."""

    def __init__(self, config: T5Config, init, *, tp: TensorParallel, ep: ExpertParallel,
                 device=None, dtype=None) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        if config.num_experts % ep.size:
            raise ValueError(f"the number of experts ({config.num_experts}) is not divisible "
                             f"by the expert-model-parallel size {ep.size}")
        self.local = config.num_experts // ep.size
        self.first = ep.rank * self.local
        self.tp, self.ep = tp, ep
        self.gated = config.is_gated_act
        self.d_model, self.d_ff = config.d_model, config.d_ff
        ff = divide(config.d_ff, tp.size, "d_ff")
        names = ("wi_0", "wi_1") if self.gated else ("wi",)
        for name in names:
            self.register_parameter(name, self._weight((self.local, ff, config.d_model), 1,
                                                       init("wi"), device, dtype))
        self.wo = self._weight((self.local, config.d_model, ff), 2, init("wo"), device, dtype)
        self.act = activation_function(config.activation)
        self.dropout_p = config.dropout_rate

    def _weight(self, shape, tp_dim: int, init_method, device, dtype) -> nn.Parameter:
        """This rank's [local, ...] slice of the stacked weight; tp_dim: the dimension split
        over tensor ranks. The block's stream gives one seed per expert (every rank draws them
        all: a few integers); each local expert is then drawn as a full dense weight from its
        own seed and this rank keeps its tensor shard. The same weights at any EP and TP, and a
        rank draws only its E / EP experts (CPM-2-MoE: 32 experts of 3 x 42M weights per
        layer)."""
        weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        set_tensor_model_parallel_attributes(weight, True, tp_dim, 1)
        weight.expert_parallel = True  # averaged over the expert-data-parallel group only
        if weight.device.type != "meta":
            full = list(shape[1:])
            full[tp_dim - 1] *= self.tp.size
            seeds = torch.randint(0, 2 ** 62, (self.num_experts,)).tolist()
            with torch.no_grad():
                for e in range(self.first, self.first + self.local):
                    master = host_fp32(full)
                    with torch.random.fork_rng(devices=[]):
                        torch.manual_seed(seeds[e])
                        init_method(master)
                    weight[e - self.first].copy_(
                        shard(master, tp_dim - 1, 1, self.tp.rank, self.tp.size))
        return weight

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows [N, d_model] sorted by local expert, counts [local]: their outputs (this tensor
        rank's partial sums)."""
        if self.gated:
            inner = self.act(grouped_linear(rows, self.wi_0, counts)) \
                * grouped_linear(rows, self.wi_1, counts)
        else:
            inner = self.act(grouped_linear(rows, self.wi, counts))
        if self.training and self.dropout_p > 0:
            with get_cuda_rng_tracker().fork():
                inner = dropout(inner, self.dropout_p)
        return grouped_linear(inner, self.wo, counts)


class Router(nn.Module):
    """The router's linear layer (Hugging Face's `router.classifier`), replicated on tensor ranks
    and computed in float32; with expert bias, the bias buffer (`router.expert_bias`)."""

    def __init__(self, config: T5Config, init, device=None, dtype=None) -> None:
        super().__init__()
        self.classifier = nn.Linear(config.d_model, config.num_experts, bias=config.router_bias,
                                    device=device, dtype=dtype)
        self.jitter = config.router_jitter_noise
        if self.classifier.weight.device.type != "meta":
            with torch.no_grad():
                master = torch.empty(self.classifier.weight.shape, dtype=torch.float32)
                init("router")(master)
                self.classifier.weight.copy_(master)
                if self.classifier.bias is not None:
                    self.classifier.bias.zero_()
        if config.moe_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(config.num_experts,
                                                            dtype=torch.float32, device=device))
        else:
            self.expert_bias = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, S, d_model] -> float32 logits [B, S, experts]."""
        hidden = hidden.float()
        if self.training and self.jitter > 0:
            hidden = hidden * torch.empty_like(hidden).uniform_(1 - self.jitter, 1 + self.jitter)
        bias = self.classifier.bias
        return F.linear(hidden, self.classifier.weight.float(),
                        None if bias is None else bias.float())


class MoEStats:
    """What a sparse layer saw since the last read (the log line): sums over its calls."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.calls = 0
        self.aux_loss = 0.0
        self.z_loss = 0.0
        self.dropped = 0.0
        self.choices = 0.0
        self.load: Optional[torch.Tensor] = None
        """Token choices per expert (before capacity), float64 [experts], this rank's tokens."""

    def add(self, aux, z, dropped, choices, load) -> None:
        self.calls += 1
        self.aux_loss = self.aux_loss + aux
        self.z_loss = self.z_loss + z
        self.dropped = self.dropped + dropped
        self.choices = self.choices + choices
        self.load = load if self.load is None else self.load + load


class SparseMLP(nn.Module):
    """The Mixture-of-Experts feed-forward (module docstring): forward(hidden, test_time_routing)
    -> (output, the weighted balancing losses of this call, or None). These routers route in
    evaluation as at test time already, so `test_time_routing` changes nothing here (router
    'cpm2' differs: moe_cpm2.py)."""

    ranges = staticmethod(_no_range)
    """ranges(name, nbytes): the step's named ranges around the all-to-all (the profiler and
    the timing listeners set it on the instance: megatron/training/profiling.py)."""

    def __init__(self, config: T5Config, init, *, tp: TensorParallel, ep: ExpertParallel,
                 sparse_layers: int, device=None, dtype=None) -> None:
        super().__init__()
        self.router = self.make_router(config, init, device, dtype)
        self.experts = Experts(config, init, tp=tp, ep=ep, device=device, dtype=dtype)
        self.num_experts, self.tp, self.ep = config.num_experts, tp, ep
        self.router_type = config.router_type
        self.k = config.router_k
        self.capacity_factor = config.expert_capacity_factor
        self.eval_capacity_factor = config.eval_expert_capacity_factor
        self.expert_capacity = config.expert_capacity
        self.aux_coef = config.router_aux_loss_coef / sparse_layers
        self.z_coef = config.router_z_loss_coef / sparse_layers
        self.stats = MoEStats()
        self.step_load: Optional[torch.Tensor] = None
        """Token choices per expert since the last `update_expert_bias` (expert bias only)."""

    def make_router(self, config: T5Config, init, device, dtype) -> nn.Module:
        return Router(config, init, device, dtype)

    def capacity(self, length: int) -> Optional[int]:
        """Choices an expert takes per sequence of `length` tokens (None: dropless). BASE
        routing drops nothing: its assignment is balanced (a Hugging Face folder's
        `expert_capacity`, always written there, is ignored)."""
        if self.router_type == "base":
            return None
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if factor is not None:
            # the factor as written (1.1 is 11/10): in binary floating point 1.1 x 2 x 100 / 4
            # is 55.00000000000001, one choice more than the formula's 55
            exact = Fraction(str(factor)) * self.k * length / self.num_experts
            return max(1, math.ceil(exact))
        return self.expert_capacity

    def forward_flops(self, tokens: int) -> int:
        """Forward FLOPs over `tokens` positions: the router, and k experts per token (the
        active parameters; dropped choices are counted)."""
        experts = self.experts
        per_token = 2 * experts.d_model * experts.d_ff * (3 if experts.gated else 2)
        return tokens * (2 * experts.d_model * self.num_experts + self.k * per_token)

    def forward(self, hidden: torch.Tensor, test_time_routing: bool = False):
        batch, length, width = hidden.shape
        logits = self.router(hidden)
        routing = route(logits, self.router_type, self.k, self.capacity(length), self.training,
                        self.router.expert_bias)
        out = self._experts(hidden.reshape(batch * length, width), routing)
        chosen = routing.experts.reshape(batch, length, -1)
        aux, balance, z = None, 0.0, 0.0
        if self.router_type != "base" and self.training:  # (also in a checkpointed forward)
            balance = load_balancing_loss(routing.probs, chosen)
            z = router_z_loss(logits)
            aux = self.aux_coef * balance + self.z_coef * z
            balance, z = balance.detach(), z.detach()
        if not self.training or is_recomputing():  # training forwards are counted, once
            return out.reshape(batch, length, width), aux
        load = torch.bincount(routing.experts.reshape(-1), minlength=self.num_experts).double()
        self.stats.add(balance, z, (~routing.kept).sum().double(), float(routing.kept.numel()),
                       load)
        if self.router.expert_bias is not None and self.training:
            self.step_load = load if self.step_load is None else self.step_load + load
        return out.reshape(batch, length, width), aux

    def _experts(self, tokens: torch.Tensor, routing: Routing) -> torch.Tensor:
        """The weighted sum of each token's kept experts' outputs, [T, d_model]."""
        k = routing.experts.shape[1]
        keep = routing.kept.reshape(-1).nonzero().squeeze(1)
        expert = routing.experts.reshape(-1)[keep]
        order = torch.argsort(expert, stable=True)
        expert, keep = expert[order], keep[order]
        token, weight = keep // k, routing.weights.reshape(-1)[keep]
        counts = torch.bincount(expert, minlength=self.num_experts)
        rows = copy_to_tensor_model_parallel_region(tokens, self.tp)[token]
        if self.ep.size == 1:
            out = self.experts(rows, counts)
        else:
            out = self._exchange(rows, counts)
        out = reduce_from_tensor_model_parallel_region(out, self.tp)
        combined = tokens.new_zeros(tokens.shape)
        return combined.index_add(0, token, out * weight[:, None].to(out.dtype))

    def _exchange(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows sorted by global expert -> their experts' ranks -> the local experts -> back."""
        ep, local = self.ep, self.experts.local
        sent = counts.reshape(ep.size, local)
        received = torch.empty_like(sent)
        sent_counts = sent.contiguous()
        with self.ranges(ALL_TO_ALL, sent_counts.numel() * sent_counts.element_size()):
            dist.all_to_all_single(received, sent_counts, group=ep.group)  # [source, local]
        send = sent.sum(1).tolist()
        receive = received.sum(1).tolist()
        arrived = _AllToAll.apply(rows, send, receive, ep.group, self.ranges)
        # from [source][local expert] blocks to [local expert][source]
        which = torch.repeat_interleave(
            torch.arange(local, device=rows.device).repeat(ep.size), received.reshape(-1))
        order = torch.argsort(which, stable=True)
        out = self.experts(arrived[order], received.sum(0))
        back = torch.empty_like(out)
        back[order] = out
        return _AllToAll.apply(back, receive, send, ep.group, self.ranges)


def sparse_layers(model: nn.Module) -> List[SparseMLP]:
    return [m for m in model.modules() if isinstance(m, SparseMLP)]


STAT_COLUMNS = ("calls", "aux_loss", "z_loss", "dropped", "choices")
"""The leading columns of `take_stats`' rows; the expert loads follow."""


def take_stats(model: nn.Module, device) -> tuple:
    """(names of the sparse layers, float64 [layers, len(STAT_COLUMNS) + experts]: each
    layer's sums since the last take: calls, balancing and z losses, dropped and all token
    choices, token choices per expert), the layers' counters reset; (names, None) without
    sparse layers. Names are the owning block's ('encoder.block.1'; in a pipeline stage, whose
    modules are numbered, from its `layer_names`)."""
    names, rows = [], []
    pipeline_names = getattr(model, "layer_names", None)
    for name, module in model.named_modules():
        if not isinstance(module, SparseMLP):
            continue
        stats = module.stats
        load = stats.load if stats.load is not None else \
            torch.zeros(module.num_experts, dtype=torch.float64)
        head = torch.tensor([float(stats.calls)], dtype=torch.float64)
        values = [torch.as_tensor(v, dtype=torch.float64).reshape(1).cpu()
                  for v in (stats.aux_loss, stats.z_loss, stats.dropped, stats.choices)]
        rows.append(torch.cat([head, *values, load.double().cpu()]))
        owner = name.split(".layer.")[0]
        index = owner.partition(".")[0]
        names.append(pipeline_names[int(index)] if pipeline_names and index.isdigit() else owner)
        stats.reset()
    if not rows:
        return names, None
    return names, torch.stack(rows).to(device)


def expert_bias_layers(model: nn.Module) -> List[SparseMLP]:
    """The sparse layers of `model` that balance by expert bias."""
    return [layer for layer in sparse_layers(model) if layer.router.expert_bias is not None]


def update_expert_bias(layers, rate: float, group=None) -> None:
    """After an optimizer step: move each expert bias toward equal load, by `rate` times the
    sign of (mean load - the expert's load), the load counted over the step's tokens on every
    rank of `group` (the data-parallel group). `layers`: `expert_bias_layers` (a module: its
    own). One all-reduce over `group` for all of them; nothing without expert bias."""
    if isinstance(layers, nn.Module):
        layers = expert_bias_layers(layers)
    if not layers:
        return
    device = layers[0].router.expert_bias.device
    loads = torch.stack([
        (layer.step_load if layer.step_load is not None else
         torch.zeros(layer.num_experts, dtype=torch.float64)).to(device, torch.float64)
        for layer in layers])
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(loads, group=group)
    for layer, load in zip(layers, loads):
        layer.router.expert_bias.add_(rate * torch.sign(load.mean() - load).float())
        layer.step_load = None
