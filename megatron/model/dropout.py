"""Dropout that is cheap on CPU.

torch's CPU dropout draws one Bernoulli sample per element from a 32-bit generator and keeps a
float mask; on T5's attention probabilities that is a sixth of a CPU training step. Here the mask
comes from 16-bit random integers compared with a threshold (the keep probability is rounded to a
multiple of 1/65536, within 8e-6 of the one asked for) and is kept as booleans. On CUDA torch's
fused dropout is already fast and is used as it is. Both draw from the current default generator
of the tensor's device, so the tensor-parallel RNG tracker governs them the same way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_LEVELS = 1 << 16


class _MaskedScale(torch.autograd.Function):
    """where(keep, x, 0) * scale: two passes, no float copy of the boolean mask."""

    @staticmethod
    def forward(ctx, tensor, keep, scale):
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return masked_scale(tensor, keep, scale)

    @staticmethod
    def backward(ctx, grad):
        (keep,) = ctx.saved_tensors
        return masked_scale(grad, keep, ctx.scale), None, None


def masked_scale(tensor: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
    """where(keep, tensor, 0) * scale, a new tensor (no autograd of its own)."""
    return torch.where(keep, tensor, 0.0).mul_(scale)


def dropout(tensor: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """Zero each element with probability p and scale the rest by 1 / (1 - p)."""
    if not training or p == 0.0:
        return tensor
    if tensor.device.type != "cpu":
        return F.dropout(tensor, p=p, training=True)
    return _MaskedScale.apply(tensor, keep_mask(tensor.shape, p, tensor.device), 1.0 / (1.0 - p))


def keep_mask(shape, p: float, device) -> torch.Tensor:
    """The CPU path's booleans, True where an element is kept (probability 1 - p, rounded to a
    multiple of 1/65536), drawn from the current default generator."""
    threshold = round(p * _LEVELS) - _LEVELS // 2
    draws = torch.randint(-(_LEVELS // 2), _LEVELS // 2, shape, dtype=torch.int16, device=device)
    return draws >= threshold


class Dropout(nn.Module):
    """nn.Dropout with the CPU fast path above."""

    def __init__(self, p: float) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability {p} must be in [0, 1)")
        self.p = p

    def forward(self, tensor: torch.Tensor) -> torch.Tensor:
        return dropout(tensor, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"
