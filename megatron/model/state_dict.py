"""Full (unsharded, unpadded) state dicts: load into a tensor-parallel model, gather out of one,
and convert to and from Hugging Face T5ForConditionalGeneration names.

Our parameter names are Hugging Face's; the differences are only that Hugging Face also lists
the tied copies (`encoder.embed_tokens.weight`, `decoder.embed_tokens.weight`, and `lm_head.weight`
when tied) and that our vocabulary rows are padded for tensor parallelism.
"""

from __future__ import annotations

from typing import Dict

import torch
import torch.distributed as dist

from megatron import parallel_state
from megatron.model.config import T5Config
from megatron.tensor_parallel.layers import shard

StateDict = Dict[str, torch.Tensor]
VOCAB_PARAMETERS = ("shared.weight", "lm_head.weight")
HF_TIED_COPIES = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
# Hugging Face checkpoints of some versions carry this unused parameter; it is ignored on load.
HF_IGNORED = ("decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight",)


class StateDictError(ValueError):
    """Names or shapes that do not fit the model; the message lists all of them."""


def from_hf_state_dict(hf: StateDict, config: T5Config) -> StateDict:
    """Our full state dict from a Hugging Face T5ForConditionalGeneration one."""
    out = {k: v for k, v in hf.items() if k not in HF_TIED_COPIES and k not in HF_IGNORED}
    if config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def to_hf_state_dict(full: StateDict, config: T5Config) -> StateDict:
    """A Hugging Face T5ForConditionalGeneration state dict from our full one."""
    out = dict(full)
    for name in HF_TIED_COPIES:
        out[name] = full["shared.weight"]
    if config.tie_word_embeddings:
        out["lm_head.weight"] = full["shared.weight"]
    return out


def load_full_state_dict(model: torch.nn.Module, full: StateDict) -> None:
    """Pad the vocabulary rows, keep this rank's tensor-parallel shard, load (strict).

    Raises:
        StateDictError: missing or unexpected names, or shapes that differ, all listed.
    """
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(full))
    unexpected = sorted(set(full) - set(params))
    problems = []
    if missing:
        problems.append(f"missing: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected: {', '.join(unexpected)}")
    local = {}
    vocab = model.config.vocab_size
    for name, param in params.items():
        if name not in full:
            continue
        tensor = full[name]
        if name in VOCAB_PARAMETERS:
            if tensor.shape[0] != vocab:
                problems.append(f"{name}: {tensor.shape[0]} rows, the config's vocab_size is "
                                f"{vocab}")
                continue
            rows = model.padded_vocab_size - vocab
            tensor = torch.cat([tensor, tensor.new_zeros(rows, *tensor.shape[1:])])
        if getattr(param, "tensor_model_parallel", False):
            tensor = shard(tensor, param.partition_dim, param.partition_stride)
        if tensor.shape != param.shape:
            problems.append(f"{name}: shape {tuple(tensor.shape)} does not fit "
                            f"{tuple(param.shape)}")
            continue
        local[name] = tensor
    if problems:
        raise StateDictError("state dict does not fit the model: " + "; ".join(problems))
    with torch.no_grad():
        for name, tensor in local.items():
            params[name].copy_(tensor)


def gather_full_state_dict(model: torch.nn.Module, grads: bool = False) -> StateDict:
    """The full parameters (or their gradients) of a tensor-parallel model, vocabulary unpadded;
    every tensor rank gets the whole dict. Parameters without a gradient are left out when
    `grads` is set."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    out = {}
    for name, param in model.named_parameters():
        tensor = param.grad if grads else param.detach()
        if tensor is None:
            continue
        if tp > 1 and getattr(param, "tensor_model_parallel", False):
            parts = [torch.empty_like(tensor) for _ in range(tp)]
            dist.all_gather(parts, tensor.contiguous(),
                            group=parallel_state.get_tensor_model_parallel_group())
            tensor = _unshard(parts, param.partition_dim, param.partition_stride)
        if name in VOCAB_PARAMETERS:
            tensor = tensor[:model.config.vocab_size]
        out[name] = tensor.clone()
    return out


def _unshard(parts, dim: int, stride: int) -> torch.Tensor:
    if stride == 1:
        return torch.cat(parts, dim=dim)
    blocks = [torch.chunk(p, stride, dim=dim) for p in parts]
    return torch.cat([blocks[r][s] for s in range(stride) for r in range(len(parts))], dim=dim)
