"""The pieces of a T5 block, as in Hugging Face's modeling_t5.py, with tensor-parallel linears.

Names follow Hugging Face (`q`, `k`, `v`, `o`, `relative_attention_bias`, `wi`, `wi_0`, `wi_1`,
`wo`, `layer_norm`, `layer.0/1/2`), so a state dict converts by name. Heads and the feed-forward
width are split over tensor-parallel ranks (q, k, v, wi column-parallel; o, wo row-parallel; the
relative attention bias by heads). With TP=1 the same classes are plain math.

T5's particulars: RMSNorm without bias or mean, variance in fp32; no 1/sqrt(d_kv) scaling of
the scores; an additive relative position bias computed by block 0 of each stack and reused by
the others; no position bias in cross-attention; bias-free linears.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron.model.config import T5Config
from megatron.model.dropout import Dropout, dropout
from megatron.model.eager_attention import eager_attention
from megatron.model.nonlinearity import activation_function
from megatron.tensor_parallel.layers import (
    ColumnParallelLinear,
    InitMethod,
    RowParallelLinear,
    initialize_shard,
    divide,
    normal_init,
    set_tensor_model_parallel_attributes,
)
from megatron.model.flex import FlexBias, flex_core_attention, key_valid_from_additive
from megatron.model.moe import SparseMLP
from megatron.model.moe_cpm2 import CPM2SparseMLP
from megatron.tensor_parallel.group import NO_EXPERT_PARALLEL, ExpertParallel, TensorParallel
from megatron.tensor_parallel.random import get_cuda_rng_tracker, init_rng


class Carry(NamedTuple):
    """What every layer of the flat layer list takes and returns.

    hidden: [batch, length, d_model] of the stack being run (before the first layer: the
        encoder input ids; after the encoder: None until the decoder embeds its ids).
    encoder_output: [batch, enc_len, d_model], None until the encoder has finished.
    encoder_mask: [batch, 1, 1, enc_len], additive (0 or the float32 minimum).
    decoder_mask: [batch, 1, dec_len, dec_len], additive, causal and padding.
    position_bias: [batch, heads per rank, length, length], the current stack's self-attention
        bias: relative position bias plus the stack's mask, computed once by its block 0 (None
        before it) and reused by the other blocks.
    decoder_input_ids: [batch, dec_len], read by the decoder's embedding step.
    aux_loss: the weighted balancing losses of the sparse blocks run so far (a float32 scalar;
        None in a dense model, in evaluation, and before the first sparse block).
    test_time_routing: the sparse blocks route as at test time (set by a caller that decodes,
        megatron/generation/; only router 'cpm2' routes otherwise in evaluation).
    """

    hidden: Optional[torch.Tensor]
    encoder_output: Optional[torch.Tensor]
    encoder_mask: torch.Tensor
    decoder_mask: torch.Tensor
    position_bias: Optional[torch.Tensor]
    decoder_input_ids: torch.Tensor
    aux_loss: Optional[torch.Tensor] = None
    test_time_routing: bool = False


# Standard deviation of a unit normal truncated to [-2, 2]: a truncated draw is scaled by its
# inverse so that its standard deviation is the one asked for (as jax's variance_scaling does).
TRUNCATED_NORMAL_STD = 0.87962566103423978


def truncated_normal_init(std: float) -> InitMethod:
    """Normal truncated at two standard deviations of the untruncated draw, rescaled to `std`."""
    scale = std / TRUNCATED_NORMAL_STD

    def init(tensor: torch.Tensor) -> None:
        nn.init.trunc_normal_(tensor, mean=0.0, std=scale, a=-2.0 * scale, b=2.0 * scale)
    return init


def uniform_init(std: float) -> InitMethod:
    """Uniform on [-sqrt(3) std, sqrt(3) std] (standard deviation `std`)."""
    limit = math.sqrt(3.0) * std

    def init(tensor: torch.Tensor) -> None:
        nn.init.uniform_(tensor, -limit, limit)
    return init


class InitMethods:
    """Initial distribution of each kind of weight, for one stack. Norm weights start at 1.

    't5x' (default): the recipe that pretrained T5 and T5 v1.1 (Mesh TensorFlow), as t5x's
        examples/t5 rebuilds it: embedding normal(1); q, k, v, o normal with std
        fan_in ** -0.5 (q also divided by sqrt(d_kv), the folded-in score scaling); the
        feed-forward wi, wo and the untied lm_head truncated normal (at 2 std) with std
        fan_in ** -0.5, so the head's is d_model ** -0.5 and the first logits are small (initial
        loss near ln(vocab)); relative attention bias uniform with variance
        2 / (num_heads + num_buckets) (fan average).
    'hf': Hugging Face's: all normal, the same standard deviations as 't5x' except the untied
        lm_head (1.0: its first logits are about sqrt(d_model) large) and the relative attention
        bias (d_model ** -0.5).
    Both are scaled by initializer_factor.
    'cpm2': normal(init_method_std), output projections (o, wo) divided by sqrt(2 * layers)
        unless use_scaled_init_for_output_weights is false.
    """

    TRUNCATED = ("wi", "wo", "lm_head")

    def __init__(self, config: T5Config, num_layers: int) -> None:
        self.config, self.num_layers = config, num_layers

    def std(self, kind: str) -> float:
        c = self.config
        if c.init_method == "cpm2":
            if kind in ("o", "wo") and c.use_scaled_init_for_output_weights:
                return c.init_method_std / math.sqrt(2.0 * self.num_layers)
            return c.init_method_std
        stds = {
            "embedding": 1.0, "lm_head": 1.0,
            "q": (c.d_model * c.d_kv) ** -0.5, "k": c.d_model ** -0.5, "v": c.d_model ** -0.5,
            "o": c.inner_dim ** -0.5, "relative_attention_bias": c.d_model ** -0.5,
            "wi": c.d_model ** -0.5, "wo": c.d_ff ** -0.5,
            "router": 1.0,
        }
        if c.init_method == "t5x":
            stds["lm_head"] = c.d_model ** -0.5
            stds["router"] = 0.02  # flaxformer's router kernel
            stds["relative_attention_bias"] = \
                (2.0 / (c.num_heads + c.relative_attention_num_buckets)) ** 0.5
        return c.initializer_factor * stds[kind]

    def __call__(self, kind: str) -> InitMethod:
        std = self.std(kind)
        if self.config.init_method == "t5x":
            if kind in self.TRUNCATED:
                return truncated_normal_init(std)
            if kind == "relative_attention_bias":
                return uniform_init(std)
        return normal_init(std)


class T5LayerNorm(nn.Module):
    """RMSNorm: scale only, no mean subtraction, variance in fp32."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, device=None, dtype=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight.device.type != "meta":
            nn.init.ones_(self.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.dtype == torch.float32 and self.weight.dtype == torch.float32 \
                and not torch.is_autocast_enabled(hidden.device.type):
            # torch's fused kernel: the same fp32 math in one pass (bitwise equal here)
            return F.rms_norm(hidden, self.weight.shape, self.weight, self.variance_epsilon)
        variance = hidden.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden = hidden * torch.rsqrt(variance + self.variance_epsilon)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            hidden = hidden.to(self.weight.dtype)
        return self.weight * hidden


def relative_position_bucket(relative_position: torch.Tensor, bidirectional: bool,
                             num_buckets: int, max_distance: int) -> torch.Tensor:
    """Mesh TensorFlow's bucketing of key_position - query_position: half the buckets for exact
    small distances, half logarithmic up to max_distance; split by sign when bidirectional."""
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = -torch.clamp(relative_position, max=0)
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    large = max_exact + (
        torch.log(distance.float() / max_exact) / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)).long()
    large = torch.clamp(large, max=num_buckets - 1)
    return buckets + torch.where(is_small, distance, large)


class RelativeAttentionBias(nn.Module):
    """The [num_buckets, num_heads] bias table, split by heads over tensor ranks (`tp`)."""

    def __init__(self, num_buckets: int, num_heads: int, init_method: InitMethod,
                 tp: TensorParallel, device=None, dtype=None) -> None:
        super().__init__()
        self.num_buckets, self.num_heads, self.init_method = num_buckets, num_heads, init_method
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(num_buckets,
                                               divide(num_heads, tp.size, "num_heads"),
                                               device=device, dtype=dtype))
        set_tensor_model_parallel_attributes(self.weight, True, 1, 1)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        initialize_shard(self.weight, (self.num_buckets, self.num_heads), 1, 1,
                          self.init_method, self.tp)

    def forward(self, buckets: torch.Tensor) -> torch.Tensor:
        """[heads per rank, *buckets.shape]: heads first and contiguous, as attention reads it
        (indexing the transposed table: no permuted copy, and a faster backward than
        F.embedding's at these sizes)."""
        return self.weight.t()[:, buckets]


def relative_bias(table: RelativeAttentionBias, config: T5Config, is_decoder: bool,
                  query_length: int, key_length: int) -> torch.Tensor:
    """[1, heads per rank, query_length, key_length] from a stack's bucket table."""
    device = table.weight.device
    context = torch.arange(query_length, dtype=torch.long, device=device)[:, None]
    memory = torch.arange(key_length, dtype=torch.long, device=device)[None, :]
    buckets = relative_position_bucket(
        memory - context, bidirectional=not is_decoder,
        num_buckets=config.relative_attention_num_buckets,
        max_distance=config.relative_attention_max_distance)
    # contiguous, heads first: a permuted bias would give the stack's [batch, heads, q, k] sum
    # its layout, and every layer would copy it to flatten batch and heads
    return table(buckets).unsqueeze(0)


def relative_bias_at(table: RelativeAttentionBias, config: T5Config, is_decoder: bool,
                     query_position: int, key_length: int) -> torch.Tensor:
    """[1, heads per rank, 1, key_length]: row `query_position` of `relative_bias`, computed
    for that one query (a decoding step) with the same buckets and table lookup."""
    memory = torch.arange(key_length, dtype=torch.long, device=table.weight.device)[None, :]
    buckets = relative_position_bucket(
        memory - query_position, bidirectional=not is_decoder,
        num_buckets=config.relative_attention_num_buckets,
        max_distance=config.relative_attention_max_distance)
    return table(buckets).unsqueeze(0)


def relative_attention_bias(config: T5Config, init: "InitMethods", is_decoder: bool,
                            tp: TensorParallel, device=None, dtype=None
                            ) -> RelativeAttentionBias:
    """A stack's bias table, drawn from a stream of its own (the same table whether block 0
    or a pipeline stage's tied copy builds it)."""
    with init_rng(("decoder" if is_decoder else "encoder") + ".relative_attention_bias"):
        return RelativeAttentionBias(config.relative_attention_num_buckets, config.num_heads,
                                     init("relative_attention_bias"), tp, device=device,
                                     dtype=dtype)


ATTENTION_BACKENDS = ("auto", "sdpa", "eager", "flex")
"""The attention kernels a model can run (T5Attention.forward picks for 'auto'), the one list
the flags and the model read."""


def core_attention(query, key, value, bias, dropout_p: float, use_sdpa: bool):
    """softmax(q k^T + bias) v over [batch, heads, length, d_kv], without score scaling.

    use_sdpa: torch's scaled_dot_product_attention; else the bias is added inside the score
    GEMM (baddbmm), which on CPU beats sdpa's math path when the bias needs a gradient.
    """
    if bias.dtype != query.dtype:
        bias = bias.to(query.dtype).clamp(min=torch.finfo(query.dtype).min)
    if use_sdpa:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=bias,
                                              dropout_p=dropout_p, scale=1.0)
    if query.device.type == "cpu" and not torch.compiler.is_compiling():
        # the same math, half the [b * h, q, k] buffers; torch.compile traces the composed ops
        # below instead (the kernel's in-place buffer tricks would break its graph)
        return eager_attention(query, key, value, bias, dropout_p)
    batch, heads, q_len, d_kv = query.shape
    k_len = key.shape[2]
    bias = bias.expand(batch, heads, q_len, k_len).reshape(batch * heads, q_len, k_len)
    scores = torch.baddbmm(bias, query.reshape(batch * heads, q_len, d_kv),
                           key.reshape(batch * heads, k_len, d_kv).transpose(1, 2))
    # in the scores' dtype: torch's kernels accumulate half types in fp32 (CPU and CUDA), so
    # an fp32 round trip would only add two copies of [batch * heads, q, k], forward and back
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    if dropout_p > 0:
        probs = dropout(probs, dropout_p)
    context = torch.bmm(probs, value.reshape(batch * heads, k_len, d_kv))
    return context.view(batch, heads, q_len, d_kv)


class T5Attention(nn.Module):
    """Self- or cross-attention; block 0's self-attention owns the relative position bias."""

    def __init__(self, config: T5Config, init: InitMethods, is_decoder: bool,
                 has_relative_attention_bias: bool = False, backend: str = "auto", *,
                 tp: TensorParallel, device=None, dtype=None) -> None:
        super().__init__()
        self.config, self.is_decoder, self.backend = config, is_decoder, backend
        d, inner = config.d_model, config.inner_dim
        self.heads_per_rank = divide(config.num_heads, tp.size, "num_heads")
        kw = dict(tp=tp, device=device, dtype=dtype)
        self.q = ColumnParallelLinear(d, inner, init_method=init("q"), **kw)
        self.k = ColumnParallelLinear(d, inner, init_method=init("k"), **kw)
        self.v = ColumnParallelLinear(d, inner, init_method=init("v"), **kw)
        self.o = RowParallelLinear(inner, d, input_is_parallel=True, init_method=init("o"), **kw)
        self.has_relative_attention_bias = has_relative_attention_bias
        if has_relative_attention_bias:
            self.relative_attention_bias = relative_attention_bias(config, init, is_decoder,
                                                                   **kw)

    def query_flops(self, query_length: int, key_length: int) -> int:
        """Forward FLOPs of one sample on the query side: q and o over the queries, and the
        score and value products (the full matrices, which the kernels compute)."""
        inner = self.config.inner_dim
        return self.q.forward_flops(query_length) + self.o.forward_flops(query_length) + \
            2 * 2 * query_length * key_length * inner

    def key_value_flops(self, key_length: int) -> int:
        """Forward FLOPs of one sample's k and v projections over its keys."""
        return self.k.forward_flops(key_length) + self.v.forward_flops(key_length)

    def compute_bias(self, query_length: int, key_length: int) -> torch.Tensor:
        """[1, heads per rank, query_length, key_length]."""
        return relative_bias(self.relative_attention_bias, self.config, self.is_decoder,
                             query_length, key_length)

    def _heads(self, projected: torch.Tensor) -> torch.Tensor:
        batch, length, _ = projected.shape
        return projected.view(batch, length, self.heads_per_rank, -1).transpose(1, 2)

    def forward(self, hidden: torch.Tensor, bias: torch.Tensor,
                key_value: Optional[torch.Tensor] = None) -> torch.Tensor:
        source = hidden if key_value is None else key_value
        query, key, value = self._heads(self.q(hidden)), self._heads(self.k(source)), \
            self._heads(self.v(source))
        dropout_p = self.config.dropout_rate if self.training else 0.0
        # 'auto': sdpa where its fused kernels apply, i.e. on CUDA; on the CPU the eager kernel
        # (model/eager_attention.py): self-attention learns its bias, which sends sdpa to its
        # math path, and for cross-attention over T5's short targets it is also the faster
        # (bench/bench_model.py). Decided by the layer, never by grad mode, so a checkpointed
        # block recomputes with the same kernel and the same random draws.
        if self.backend == "flex":  # the bias inside the kernel (model/flex.py)
            if dropout_p > 0:
                raise RuntimeError("attention backend 'flex' has no attention dropout: train "
                                   "with dropout_rate 0 or another backend (eager, sdpa)")
            if not isinstance(bias, FlexBias):  # cross-attention outside a stack: its padding
                bias = FlexBias.padding(bias)
            context = flex_core_attention(query, key, value, bias)
            batch, _, length, _ = context.shape
            return self.o(context.transpose(1, 2).reshape(batch, length, -1))
        use_sdpa = self.backend == "sdpa" or (self.backend == "auto"
                                              and query.device.type == "cuda")
        with get_cuda_rng_tracker().fork() if dropout_p > 0 else contextlib.nullcontext():
            context = core_attention(query, key, value, bias, dropout_p, use_sdpa)
        batch, _, length, _ = context.shape
        return self.o(context.transpose(1, 2).reshape(batch, length, -1))


    # Incremental decoding (megatron/generation/): keys and values come from a cache ---------
    def key_value(self, source: torch.Tensor):
        """(key, value) of `source` [batch, length, d_model], each [batch, heads per rank,
        length, d_kv]: what a decoding cache keeps."""
        return self._heads(self.k(source)), self._heads(self.v(source))

    def attend(self, hidden: torch.Tensor, bias: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor) -> torch.Tensor:
        """Attention of `hidden`'s queries over given keys and values (no dropout: decoding
        runs in evaluation); the flex backend decodes with sdpa or the eager kernel."""
        query = self._heads(self.q(hidden))
        use_sdpa = self.backend == "sdpa" or (self.backend in ("auto", "flex")
                                              and query.device.type == "cuda")
        context = core_attention(query, key, value, bias, 0.0, use_sdpa)
        batch, _, length, _ = context.shape
        return self.o(context.transpose(1, 2).reshape(batch, length, -1))


class T5DenseActDense(nn.Module):
    """wo(dropout(act(wi x))), or with a gate: wo(dropout(act(wi_0 x) * wi_1 x))."""

    def __init__(self, config: T5Config, init: InitMethods, *, tp: TensorParallel, device=None,
                 dtype=None) -> None:
        super().__init__()
        kw = dict(tp=tp, device=device, dtype=dtype)
        self.gated = config.is_gated_act
        if self.gated:
            self.wi_0 = ColumnParallelLinear(config.d_model, config.d_ff, init_method=init("wi"),
                                             **kw)
            self.wi_1 = ColumnParallelLinear(config.d_model, config.d_ff, init_method=init("wi"),
                                             **kw)
        else:
            self.wi = ColumnParallelLinear(config.d_model, config.d_ff, init_method=init("wi"),
                                           **kw)
        self.wo = RowParallelLinear(config.d_ff, config.d_model, init_method=init("wo"), **kw)
        self.act = activation_function(config.activation)
        self.dropout_p = config.dropout_rate

    def forward_flops(self, tokens: int) -> int:
        """Forward FLOPs over `tokens` positions: the linears (the activation is left out)."""
        wi = (self.wi_0, self.wi_1) if self.gated else (self.wi,)
        return sum(w.forward_flops(tokens) for w in wi) + self.wo.forward_flops(tokens)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.gated:
            inner = self.act(self.wi_0(hidden)) * self.wi_1(hidden)
        else:
            inner = self.act(self.wi(hidden))
        if self.training and self.dropout_p > 0:
            with get_cuda_rng_tracker().fork():
                inner = dropout(inner, self.dropout_p)
        return self.wo(inner)


class T5LayerSelfAttention(nn.Module):
    def __init__(self, config, init, is_decoder, has_relative_attention_bias, backend, *, tp,
                 device=None, dtype=None):
        super().__init__()
        self.SelfAttention = T5Attention(config, init, is_decoder, has_relative_attention_bias,
                                         backend, tp=tp, device=device, dtype=dtype)
        self.layer_norm = T5LayerNorm(config.d_model, config.layer_norm_epsilon, device, dtype)
        self.dropout = Dropout(config.dropout_rate)

    def forward(self, hidden, bias):
        return hidden + self.dropout(self.SelfAttention(self.layer_norm(hidden), bias))


class T5LayerCrossAttention(nn.Module):
    def __init__(self, config, init, backend, *, tp, device=None, dtype=None):
        super().__init__()
        self.EncDecAttention = T5Attention(config, init, True, False, backend, tp=tp,
                                           device=device, dtype=dtype)
        self.layer_norm = T5LayerNorm(config.d_model, config.layer_norm_epsilon, device, dtype)
        self.dropout = Dropout(config.dropout_rate)

    def forward(self, hidden, encoder_output, bias):
        attended = self.EncDecAttention(self.layer_norm(hidden), bias, key_value=encoder_output)
        return hidden + self.dropout(attended)


class T5LayerFF(nn.Module):
    """The feed-forward sublayer: dense (`DenseReluDense`), or with `sparse_layers` (the count
    of sparse blocks in its stack) a Mixture-of-Experts (`mlp`, model/moe.py). forward returns
    (hidden, the sparse layer's weighted balancing losses or None); `test_time_routing` goes to
    the Mixture-of-Experts layer (a dense one has no routing)."""

    def __init__(self, config, init, *, tp, ep=NO_EXPERT_PARALLEL, sparse_layers: int = 0,
                 device=None, dtype=None):
        super().__init__()
        if sparse_layers:
            kind = CPM2SparseMLP if config.router_type == "cpm2" else SparseMLP
            self.mlp = kind(config, init, tp=tp, ep=ep, sparse_layers=sparse_layers,
                            device=device, dtype=dtype)
        else:
            self.DenseReluDense = T5DenseActDense(config, init, tp=tp, device=device,
                                                  dtype=dtype)
        self.layer_norm = T5LayerNorm(config.d_model, config.layer_norm_epsilon, device, dtype)
        self.dropout = Dropout(config.dropout_rate)

    @property
    def feed_forward(self):
        return getattr(self, "mlp", None) or self.DenseReluDense

    def forward(self, hidden, test_time_routing: bool = False):
        normed = self.layer_norm(hidden)
        if hasattr(self, "mlp"):
            out, aux = self.mlp(normed, test_time_routing)
        else:
            out, aux = self.DenseReluDense(normed), None
        return hidden + self.dropout(out), aux


def _clamp_fp16(hidden: torch.Tensor) -> torch.Tensor:
    """Keep fp16 residuals finite, as Hugging Face does (T5 activations grow large)."""
    if hidden.dtype != torch.float16:
        return hidden
    limit = torch.finfo(torch.float16).max
    limit = torch.where(torch.isinf(hidden).any(), limit - 1000, limit)
    return torch.clamp(hidden, min=-limit, max=limit)


def attention_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype the attention scores are computed in: autocast's where autocast is on (the
    projections it feeds run in it), else the activations'."""
    if torch.is_autocast_enabled(hidden.device.type):
        return torch.get_autocast_dtype(hidden.device.type)
    return hidden.dtype


def stack_position_bias(compute_bias: Callable[[int, int], torch.Tensor], mask: torch.Tensor,
                        hidden: torch.Tensor) -> torch.Tensor:
    """A stack's self-attention bias: the relative position bias plus the additive mask, in
    the dtype of the scores (computed once per stack, or once per pipeline stage: converted in
    every layer, each copy would be kept for backward).

    In half precision the [1, heads, q, k] relative bias is converted before it is broadcast
    over the batch, and the mask (no gradient) is converted with its minimum clamped to the
    dtype's, so no [batch, heads, q, k] tensor is converted or clamped, forward or backward;
    fp16 alone clamps the sum (a masked position's bias could round past its range)."""
    length = hidden.shape[1]
    dtype = attention_dtype(hidden)
    bias = compute_bias(length, length)
    if dtype in (torch.float16, torch.bfloat16):
        minimum = torch.finfo(dtype).min
        bias = bias.to(dtype) + mask.to(dtype).clamp(min=minimum)
        return bias.clamp(min=minimum) if dtype == torch.float16 else bias
    return bias + mask


class T5Block(nn.Module):
    """Self-attention, cross-attention (decoder only) and feed-forward; one layer of the flat
    list: takes and returns a Carry."""

    def __init__(self, config: T5Config, init: InitMethods, is_decoder: bool,
                 has_relative_attention_bias: bool, backend: str = "auto", *,
                 tp: TensorParallel, ep: ExpertParallel = NO_EXPERT_PARALLEL,
                 sparse_layers: int = 0, device=None, dtype=None) -> None:
        super().__init__()
        self.is_decoder = is_decoder
        self.is_sparse = bool(sparse_layers)
        kw = dict(tp=tp, device=device, dtype=dtype)
        self.layer = nn.ModuleList([T5LayerSelfAttention(config, init, is_decoder,
                                                         has_relative_attention_bias, backend,
                                                         **kw)])
        if is_decoder:
            self.layer.append(T5LayerCrossAttention(config, init, backend, **kw))
        self.layer.append(T5LayerFF(config, init, ep=ep, sparse_layers=sparse_layers, **kw))

    def forward_flops(self, length: int, encoder_length: int = 0,
                      cross_key_value: bool = True) -> int:
        """Forward FLOPs of one sample of `length` positions (a decoder block attends to
        `encoder_length` encoder positions; `cross_key_value=False` leaves out its k and v
        projections of the encoder output, which run over encoder tokens). Norms, the bias and
        the softmax are left out: the linears and the attention products only."""
        attention = self.layer[0].SelfAttention
        flops = attention.query_flops(length, length) + attention.key_value_flops(length)
        if self.is_decoder:
            cross = self.layer[1].EncDecAttention
            flops += cross.query_flops(length, encoder_length)
            if cross_key_value:
                flops += cross.key_value_flops(encoder_length)
        return flops + self.layer[-1].feed_forward.forward_flops(length)

    def decode_step(self, hidden: torch.Tensor, self_bias: torch.Tensor,
                    cross_bias: torch.Tensor, cache, test_time_routing: bool = False
                    ) -> torch.Tensor:
        """A decoder block on the newest position only: hidden [batch, 1, d_model].

        self_bias: [1 or batch, heads per rank, 1, positions so far] (relative bias; every
            earlier position is attended). cross_bias: the additive encoder mask
            [batch, 1, 1, enc_len]. cache: this block's part of a decoding cache
            (megatron/generation/cache.py): `append(key, value)` adds the new position's
            self-attention keys and values and returns all of them; `cross` holds the
            cross-attention (key, value) of the encoder output, computed once.
        test_time_routing: the feed-forward's routing (T5LayerFF).
        """
        sub = self.layer[0]
        normed = sub.layer_norm(hidden)
        key, value = cache.append(*sub.SelfAttention.key_value(normed))
        hidden = _clamp_fp16(hidden + sub.SelfAttention.attend(normed, self_bias, key, value))
        sub = self.layer[1]
        hidden = _clamp_fp16(hidden + sub.EncDecAttention.attend(sub.layer_norm(hidden),
                                                                 cross_bias, *cache.cross))
        hidden, _ = self.layer[-1](hidden, test_time_routing)
        return _clamp_fp16(hidden)

    def forward(self, carry: Carry) -> Carry:
        hidden, position_bias = carry.hidden, carry.position_bias
        attention = self.layer[0].SelfAttention
        if position_bias is None:
            if not attention.has_relative_attention_bias:
                raise RuntimeError("the first block of a stack must own the relative "
                                   "attention bias")
            mask = carry.decoder_mask if self.is_decoder else carry.encoder_mask
            if attention.backend == "flex":
                config = attention.config
                position_bias = FlexBias(attention.relative_attention_bias.weight,
                                         not self.is_decoder,
                                         config.relative_attention_num_buckets,
                                         config.relative_attention_max_distance,
                                         key_valid_from_additive(mask), self.is_decoder)
                if self.is_decoder:  # cross-attention's padding, once for the stack's blocks
                    carry = carry._replace(encoder_mask=FlexBias.padding(carry.encoder_mask))
            else:
                position_bias = stack_position_bias(attention.compute_bias, mask, hidden)
        hidden = _clamp_fp16(self.layer[0](hidden, position_bias))
        if self.is_decoder:
            hidden = _clamp_fp16(self.layer[1](hidden, carry.encoder_output, carry.encoder_mask))
        hidden, aux = self.layer[-1](hidden, carry.test_time_routing)
        hidden = _clamp_fp16(hidden)
        aux_loss = carry.aux_loss
        if aux is not None:
            aux_loss = aux if aux_loss is None else aux_loss + aux
        return carry._replace(hidden=hidden, position_bias=position_bias, aux_loss=aux_loss)
