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

from megatron import parallel_state


def _all_reduce(tensor: torch.Tensor, op) -> torch.Tensor:
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(tensor, op=op, group=parallel_state.get_tensor_model_parallel_group())
    return tensor


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_size, ignore_index, label_smoothing):
        logits_dtype = logits.dtype
        per_rank = logits.shape[-1]
        start = parallel_state.get_tensor_model_parallel_rank() * per_rank
        columns = torch.arange(start, start + per_rank, device=logits.device)
        padded = columns >= vocab_size  # [per_rank]
        logits = logits.float().masked_fill(padded, float("-inf"))

        row_max = logits.max(dim=-1).values
        _all_reduce(row_max, dist.ReduceOp.MAX)
        logits = logits - row_max.unsqueeze(-1)

        ignored = target == ignore_index
        safe_target = target.masked_fill(ignored, 0)
        in_range = (safe_target >= start) & (safe_target < start + per_rank)
        local_target = (safe_target - start).masked_fill(~in_range, 0)
        target_logit = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(~in_range, 0.0)
        _all_reduce(target_logit, dist.ReduceOp.SUM)

        exp = logits.exp()
        sum_exp = exp.sum(dim=-1)
        _all_reduce(sum_exp, dist.ReduceOp.SUM)
        log_sum_exp = sum_exp.log()
        loss = log_sum_exp - target_logit
        if label_smoothing > 0:
            logit_sum = logits.masked_fill(padded, 0.0).sum(dim=-1)
            _all_reduce(logit_sum, dist.ReduceOp.SUM)
            mean_log_prob = logit_sum / vocab_size - log_sum_exp
            loss = (1.0 - label_smoothing) * loss - label_smoothing * mean_log_prob
        loss = loss.masked_fill(ignored, 0.0)

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, in_range, local_target, ignored, padded)
        ctx.label_smoothing, ctx.vocab_size = label_smoothing, vocab_size
        ctx.logits_dtype = logits_dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, in_range, local_target, ignored, padded = ctx.saved_tensors
        eps = ctx.label_smoothing
        grad = softmax.clone()
        hit = in_range.unsqueeze(-1) & (
            torch.arange(grad.shape[-1], device=grad.device) == local_target.unsqueeze(-1))
        grad = grad - hit.float() * (1.0 - eps)
        if eps > 0:
            grad = grad - (~padded).float() * (eps / ctx.vocab_size)
        grad = grad * grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1)
        return grad.to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor,
                                 vocab_size: Optional[int] = None, ignore_index: int = -100,
                                 label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-token loss [...] (0 where target == ignore_index) from this rank's logits [..., V/tp].

    Args:
        logits: this rank's slice of the (padded) vocabulary, any float dtype; math is fp32.
        target: global token ids, or ignore_index.
        vocab_size: the true vocabulary size; columns at or past it are excluded. Default: the
            padded size (nothing excluded).
        label_smoothing: as torch.nn.functional.cross_entropy's, over the true vocabulary.
    """
    if vocab_size is None:
        vocab_size = logits.shape[-1] * parallel_state.get_tensor_model_parallel_world_size()
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label smoothing {label_smoothing} must be in [0, 1)")
    return _VocabParallelCrossEntropy.apply(logits, target, vocab_size, ignore_index,
                                            label_smoothing)
