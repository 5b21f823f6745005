"""Worker body of the flex attention test under tensor parallelism (importable by spawned
processes)."""

from __future__ import annotations

import torch

from megatron import parallel_state
from megatron.model import T5Config, T5Model
from megatron.model import flex
from megatron.model.state_dict import load_full_state_dict
from megatron.tensor_parallel import gather_from_tensor_model_parallel_region


def flex_logits(rank, world_size, fields, full_state, batch, compiled):
    """The full logits of a TP=world_size model with attention backend 'flex' (evaluation)."""
    parallel_state.initialize_model_parallel(world_size, 1)
    flex.COMPILED = compiled
    model = T5Model(T5Config(**fields), attention_backend="flex").eval()
    load_full_state_dict(model, full_state)
    with torch.no_grad():
        logits = model(*batch).logits
    full = gather_from_tensor_model_parallel_region(logits, model.tensor_parallel)
    return full[..., :fields["vocab_size"]]
