"""T5's eager attention, softmax(q k^T + bias) v without score scaling, as one autograd function
that keeps two [batch * heads, q, k] buffers alive instead of four.

Composed from torch ops, the forward allocates the scores and then the probabilities, and the
backward the probabilities' gradient and then the scores' gradient: four fresh tensors of
[batch * heads, q, k] per layer, each of which a CPU first touches page by page (a 32 MiB tensor
at 512 tokens costs about as long to fault in as its softmax takes to compute). Here:

- forward: the scores are computed into one buffer (the bias copied in, once, then the GEMM
  added on) and the softmax runs in place on the CPU, whose last-dimension kernel reads each
  element before writing it (tests/attention/test_eager_attention.py checks it against torch.softmax);
- backward: the probabilities' gradient dP = dO V^T is turned into the scores' gradient
  dS = P * (dP - rowsum(dP * P)) in place, by torch's softmax backward kernel, which on the CPU
  also reads each element before writing it (tested the same way); dS is also the bias's gradient.

Dropout on the probabilities draws its mask exactly as megatron.model.dropout does, so a run
gives the same numbers whichever path computes it. Used for the eager backend on the CPU; other
devices compose torch ops (sdpa is their default).
"""

from __future__ import annotations

import torch

from megatron.model.dropout import keep_mask, masked_scale


class _EagerAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, query, key, value, bias, dropout_p: float):
        batch, heads, q_len, d_kv = query.shape
        k_len = key.shape[2]
        q3 = query.reshape(batch * heads, q_len, d_kv)
        k3 = key.reshape(batch * heads, k_len, d_kv)
        v3 = value.reshape(batch * heads, k_len, d_kv)
        flat_bias = bias.expand(batch, heads, q_len, k_len).reshape(batch * heads, q_len, k_len)
        if flat_bias.untyped_storage().data_ptr() == bias.untyped_storage().data_ptr():
            # a view of the bias (its own shape, or broadcast where one head makes that a view)
            scores = torch.baddbmm(flat_bias, q3, k3.transpose(1, 2))
        else:  # a broadcast bias (a mask): reshape made the buffer, the GEMM adds on in place
            # (out=, not baddbmm_: torch's FLOP counter counts the former)
            scores = torch.baddbmm(flat_bias, q3, k3.transpose(1, 2), out=flat_bias)
        probs = torch.ops.aten._softmax.out(scores, -1, False, out=scores)
        keep, dropped = None, probs
        if dropout_p > 0:
            keep = keep_mask(probs.shape, dropout_p, probs.device)
            dropped = masked_scale(probs, keep, 1.0 / (1.0 - dropout_p))
        context = torch.bmm(dropped, v3)
        ctx.save_for_backward(q3, k3, v3, probs, dropped if keep is not None else None, keep)
        ctx.dropout_p, ctx.shape, ctx.bias_shape = dropout_p, (batch, heads, q_len, k_len), \
            bias.shape
        return context.view(batch, heads, q_len, d_kv)

    @staticmethod
    def backward(ctx, grad_context):
        q3, k3, v3, probs, dropped, keep = ctx.saved_tensors
        batch, heads, q_len, k_len = ctx.shape
        if dropped is None:
            dropped = probs
        grad3 = grad_context.reshape(q3.shape)
        grad_value = torch.bmm(dropped.transpose(1, 2), grad3)
        grad = torch.bmm(grad3, v3.transpose(1, 2))  # dP (of the dropped probabilities)
        if keep is not None:  # dropout's backward, in place (masked_scale's math)
            grad.masked_fill_(~keep, 0.0).mul_(1.0 / (1.0 - ctx.dropout_p))
        # dS = P * (dP - rowsum(dP * P)), in place of dP (one rounding in half precision)
        torch.ops.aten._softmax_backward_data.out(grad, probs, -1, probs.dtype,
                                                  grad_input=grad)
        grad_query = torch.bmm(grad, k3)
        grad_key = torch.bmm(grad.transpose(1, 2), q3)
        grad_bias = None
        if ctx.needs_input_grad[3]:
            grad_bias = grad.view(batch, heads, q_len, k_len).sum_to_size(ctx.bias_shape)
        return (grad_query.view(batch, heads, q_len, -1), grad_key.view(batch, heads, k_len, -1),
                grad_value.view(batch, heads, k_len, -1), grad_bias, None)


def eager_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    bias: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
    """softmax(q k^T + bias) v over [batch, heads, length, d_kv] on the CPU; `bias` broadcasts
    to [batch, heads, q, k] and has the query's dtype."""
    if query.device.type != "cpu":
        raise ValueError("eager_attention is the CPU kernel; other devices compose torch ops")
    return _EagerAttention.apply(query, key, value, bias, dropout_p)
