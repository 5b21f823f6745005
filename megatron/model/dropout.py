"""Dropout that is cheap on CPU.

torch's CPU dropout draws one Bernoulli sample per element from a 32-bit generator and keeps a
float mask; on T5's attention probabilities that is a sixth of a CPU training step. Here each
32-bit draw of the generator (torch's CPU generator is serial, so draws are what cost) gives two
elements: its two 16-bit halves, each cut to 15 uniform bits, are compared with a threshold (the
keep probability is rounded to a multiple of 1/32768, within 1.6e-5 of the one asked for), and
the mask is kept as booleans. On CUDA torch's fused dropout is already fast and is used as it is,
and so is torch's dropout under torch.compile. Both draw from the current default generator of the
tensor's device, so the tensor-parallel RNG tracker governs them the same way.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

_LEVELS = 1 << 15


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
    if tensor.device.type != "cpu" or torch.compiler.is_compiling():
        # torch's fused dropout on CUDA; under torch.compile, the one its compiler fuses and
        # draws from its own generator (the int16 view of int32 draws below is not traceable)
        return F.dropout(tensor, p=p, training=True)
    return _MaskedScale.apply(tensor, keep_mask(tensor.shape, p, tensor.device), 1.0 / (1.0 - p))


def keep_mask(shape, p: float, device) -> torch.Tensor:
    """The CPU path's booleans, True where an element is kept (probability 1 - p, rounded to a
    multiple of 1/32768), drawn from the current default generator: one 32-bit draw per two
    elements."""
    count = math.prod(shape)
    # random_() on int32 is uniform over [0, 2**31): each 16-bit half holds 15 uniform bits
    # (bits 0-14 and 16-30) once the top bit of the half is cleared.
    halves = torch.empty((count + 1) // 2, dtype=torch.int32, device=device).random_()
    halves = halves.view(torch.int16)[:count].bitwise_and_(_LEVELS - 1)
    return (halves >= round(p * _LEVELS)).view(shape)


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
