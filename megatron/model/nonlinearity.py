"""The feed-forward activations by their Hugging Face names (dense and expert layers share them)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def activation_function(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """'relu', 'gelu' (exact), 'gelu_new' / 'gelu_pytorch_tanh' (tanh), 'silu' / 'swish'."""
    if name == "relu":
        return F.relu
    if name == "gelu":
        return F.gelu
    if name in ("gelu_new", "gelu_pytorch_tanh"):
        return lambda x: F.gelu(x, approximate="tanh")
    return F.silu  # silu, swish
