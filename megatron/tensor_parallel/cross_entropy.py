"""Cross entropy over vocabulary-parallel logits, in fp32, without gathering the vocabulary.

Each tensor rank holds the logits of its slice of the (padded) vocabulary. The max, the sum of
exponentials and the target logit are each one all-reduce over the tensor group. Columns at or
past the true vocabulary size (padding added so the table divides by the TP size) are masked out
of the softmax, so the loss equals the unpadded one exactly.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron.tensor_parallel.group import TensorParallel
from megatron.tensor_parallel.mappings import all_reduce_tensor_parallel


# exp(-87) = 1.6e-38, just above fp32's smallest normal number (1.18e-38 = exp(-87.34)); at
# exactly log(tiny) rounding can still land below it.
_LOG_FLOAT32_TINY = -87.0


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """One fused pass per row (torch's log_softmax over this rank's real columns) gives the local
    log-probabilities and the local logsumexp; one all-reduce (max, then sum) turns the local
    logsumexps into the global one. Backward turns the saved log-probabilities into the softmax,
    and that into the gradient, in place. So the [tokens, vocab / TP] matrix is read once and
    written once forward, and rewritten once backward. Because backward consumes its buffer, a
    second backward through the same loss (retain_graph) raises."""

    @staticmethod
    def forward(ctx, logits, target, vocab_size, ignore_index, label_smoothing, tp):
        per_rank = logits.shape[-1]
        start = tp.rank * per_rank
        valid = max(min(vocab_size - start, per_rank), 0)  # local columns below vocab_size
        x = logits.float()
        real = x if valid == per_rank else x[..., :valid]
        log_probs = torch.log_softmax(real, dim=-1)  # local: [..., valid]
        if valid > 0:
            local_lse = real[..., 0] - log_probs[..., 0]
        else:
            local_lse = torch.full(x.shape[:-1], float("-inf"), device=x.device)
        ctx.tensor_parallel = tp.size > 1
        if ctx.tensor_parallel:
            top = local_lse.clone()
            top = all_reduce_tensor_parallel(top, tp, dist.ReduceOp.MAX)
            total = (local_lse - top).exp_()
            total = all_reduce_tensor_parallel(total, tp, dist.ReduceOp.SUM)
            log_sum_exp = total.log_().add_(top)
        else:
            log_sum_exp = local_lse

        ignored = target == ignore_index
        in_range = (target >= start) & (target < start + valid) & ~ignored
        local_target = torch.where(in_range, target - start, torch.zeros_like(target))
        target_logit = x.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(~in_range, 0.0)
        target_logit = all_reduce_tensor_parallel(target_logit, tp, dist.ReduceOp.SUM)
        loss = log_sum_exp - target_logit
        if label_smoothing > 0:
            logit_sum = real.sum(dim=-1)
            logit_sum = all_reduce_tensor_parallel(logit_sum, tp, dist.ReduceOp.SUM)
            mean_log_prob = logit_sum / vocab_size - log_sum_exp
            loss = (1.0 - label_smoothing) * loss - label_smoothing * mean_log_prob
        loss = loss.masked_fill(ignored, 0.0)

        ctx.save_for_backward(log_probs, local_lse - log_sum_exp, in_range, local_target,
                              ignored)
        ctx.label_smoothing, ctx.vocab_size = label_smoothing, vocab_size
        ctx.per_rank, ctx.logits_dtype, ctx.consumed = per_rank, logits.dtype, False
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.consumed:
            raise RuntimeError("vocab_parallel_cross_entropy: backward reuses its buffer and "
                               "cannot run twice through the same loss (retain_graph)")
        ctx.consumed = True
        log_probs, correction, in_range, local_target, ignored = ctx.saved_tensors
        eps = ctx.label_smoothing
        if log_probs.shape[-1] == 0:  # every column of this rank is padding
            return (grad_loss.new_zeros(*log_probs.shape[:-1], ctx.per_rank,
                                        dtype=ctx.logits_dtype), None, None, None, None, None)
        if ctx.tensor_parallel:  # local log-probabilities -> global ones
            log_probs = log_probs.add_(correction.unsqueeze(-1))
        # The softmax over this rank's real columns. Log-probabilities are clamped just above the
        # log of fp32's smallest normal number first: exp would otherwise produce subnormals,
        # which x86 computes many times slower, for probabilities (< 1.7e-38) that no gradient
        # can see.
        grad = log_probs.clamp_(min=_LOG_FLOAT32_TINY).exp_()
        if eps > 0:
            grad -= eps / ctx.vocab_size
        flat = grad.view(-1, grad.shape[-1])
        rows = torch.arange(flat.shape[0], device=grad.device)
        flat[rows, local_target.reshape(-1)] -= in_range.reshape(-1).to(grad.dtype) * (1.0 - eps)
        grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        if grad.shape[-1] < ctx.per_rank:  # padded columns get no gradient
            grad = torch.nn.functional.pad(grad, (0, ctx.per_rank - grad.shape[-1]))
        return grad.to(ctx.logits_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor,
                                 vocab_size: Optional[int] = None, ignore_index: int = -100,
                                 label_smoothing: float = 0.0, *,
                                 tp: TensorParallel) -> torch.Tensor:
    """Per-token loss [...] (0 where target == ignore_index) from this rank's logits [..., V/tp].

    Args:
        logits: this rank's slice of the (padded) vocabulary, any float dtype; math is fp32.
        tp: the ranks that split the vocabulary (the head's).
        target: global token ids, or ignore_index.
        vocab_size: the true vocabulary size; columns at or past it are excluded. Default: the
            padded size (nothing excluded).
        label_smoothing: as torch.nn.functional.cross_entropy's, over the true vocabulary.
    """
    if vocab_size is None:
        vocab_size = logits.shape[-1] * tp.size
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label smoothing {label_smoothing} must be in [0, 1)")
    return _VocabParallelCrossEntropy.apply(logits, target, vocab_size, ignore_index,
                                            label_smoothing, tp)
