"""Worker bodies of the expert-parallel tests (importable by spawned processes)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron import parallel_state
from megatron.model import T5Config, T5Model
from megatron.model.state_dict import gather_full_state_dict, load_full_state_dict

from workers import seed


def expert_parallel_step(rank, world_size, fields, full_state, batch, tp, ep, checkpoint):
    """One forward and backward of this data rank's rows at TP `tp`, EP `ep` (data parallelism
    over the rest): gradients averaged over the data-parallel ranks as training does (expert
    gradients summed over the ranks holding the same experts, divided by the data-parallel
    size), gathered full; the objective averaged; this rank's logits."""
    parallel_state.initialize_model_parallel(tp, 1, ep)
    seed(1234)
    model = T5Model(T5Config(**fields), attention_backend="eager",
                    checkpoint_activations=checkpoint)
    load_full_state_dict(model, full_state)
    model.train()
    data = parallel_state.get_data_parallel_world_size()
    d = parallel_state.get_data_parallel_rank()
    rows = batch[0].shape[0] // data
    local = [t[d * rows:(d + 1) * rows] for t in batch]
    out = model(local[0], local[1], labels=local[2])
    out.objective.backward()
    for p in model.parameters():
        if getattr(p, "expert_parallel", False):
            dist.all_reduce(p.grad, group=parallel_state.get_expert_data_parallel_group())
        else:
            dist.all_reduce(p.grad, group=parallel_state.get_data_parallel_group())
        p.grad /= data
    objective = out.objective.detach().clone()
    dist.all_reduce(objective, group=parallel_state.get_data_parallel_group())
    from megatron.tensor_parallel import gather_from_tensor_model_parallel_region
    logits = gather_from_tensor_model_parallel_region(out.logits.detach(), model.tensor_parallel)
    grads = gather_full_state_dict(model, grads=True)
    return {"objective": objective / data, "logits": logits[..., :fields["vocab_size"]],
            "grads": grads if rank == 0 else None, "data_rank": d}
