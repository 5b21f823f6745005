"""Point-to-point messages between pipeline stages outside DeepSpeed's engine (decoding over
stages, megatron/generation/pipeline.py): tensors of a shape the receiver does not know go with
a shape header (`send_tensors` / `recv_tensors`), those it knows without (`send` / `recv`), and
one stage's tensor to every rank of a group (`broadcast`). Ranks are global ranks; the calls
block until the peer has taken part, so both sides call them in the same order.
"""

from __future__ import annotations

from typing import List, Sequence

import torch
import torch.distributed as dist

_HEADER = 8  # int64 entries: the number of dimensions, then the sizes


def send_tensors(tensors: Sequence[torch.Tensor], dst: int) -> None:
    """Send each tensor to global rank `dst`, its shape first (`recv_tensors` reads them).

    Raises:
        ValueError: a tensor of more than 7 dimensions (the header holds 7 sizes).
    """
    for tensor in tensors:
        if tensor.dim() >= _HEADER:
            raise ValueError(f"a {tensor.dim()}-dimensional tensor: at most {_HEADER - 1} "
                             "fit the shape header")
        header = torch.zeros(_HEADER, dtype=torch.long, device=tensor.device)
        header[0] = tensor.dim()
        header[1:1 + tensor.dim()] = torch.tensor(tensor.shape)
        dist.send(header, dst)
        dist.send(tensor.contiguous(), dst)


def recv_tensors(dtypes: Sequence[torch.dtype], src: int, device) -> List[torch.Tensor]:
    """The tensors `send_tensors` sent from global rank `src`, of the dtypes given (one
    each)."""
    out = []
    for dtype in dtypes:
        header = torch.empty(_HEADER, dtype=torch.long, device=device)
        dist.recv(header, src)
        shape = header[1:1 + int(header[0])].tolist()
        out.append(recv(shape, dtype, src, device))
    return out


def send(tensor: torch.Tensor, dst: int) -> None:
    """Send `tensor` to global rank `dst`, whose `recv` knows its shape and dtype."""
    dist.send(tensor.contiguous(), dst)


def recv(shape: Sequence[int], dtype: torch.dtype, src: int, device) -> torch.Tensor:
    """A tensor of `shape` and `dtype` sent by global rank `src` (`send`)."""
    tensor = torch.empty(list(shape), dtype=dtype, device=device)
    dist.recv(tensor, src)
    return tensor


def broadcast(tensor: torch.Tensor, src: int, group) -> torch.Tensor:
    """`tensor` of global rank `src` on every rank of `group`, in place (the others pass a
    tensor of its shape and dtype); returns it."""
    dist.broadcast(tensor, src, group=group)
    return tensor
