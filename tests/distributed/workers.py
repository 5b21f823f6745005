"""Worker bodies for the multi-process tests (importable by spawned processes, no heavy imports).

Each returns plain tensors and numbers; the tests compare them with single-process references.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron import parallel_state
from megatron.model import T5Config, T5Model
from megatron.model.state_dict import gather_full_state_dict, load_full_state_dict
from megatron.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_from_tensor_model_parallel_region,
    get_cuda_rng_tracker,
    model_parallel_seed,
    shard,
    vocab_parallel_cross_entropy,
)
from megatron.tensor_parallel.group import TensorParallel


def seed(value):
    """model_parallel_seed with this process's tensor rank (what set_seeds does in a run)."""
    model_parallel_seed(value, tensor_rank=parallel_state.get_tensor_model_parallel_rank())


def group_membership(rank, world_size, tp, pp):
    """Ranks seen in each of this rank's groups (by all-gathering the global rank)."""
    parallel_state.initialize_model_parallel(tp, pp)
    out = {}
    for kind in ("tensor_model", "data", "pipeline_model", "model"):
        group = getattr(parallel_state, f"get_{kind}_parallel_group")()
        size = dist.get_world_size(group)
        parts = [torch.zeros(1, dtype=torch.long) for _ in range(size)]
        dist.all_gather(parts, torch.tensor([rank]), group=group)
        out[kind] = [int(p) for p in parts]
    out["ranks"] = dict(
        tensor=parallel_state.get_tensor_model_parallel_rank(),
        data=parallel_state.get_data_parallel_rank(),
        pipeline=parallel_state.get_pipeline_model_parallel_rank(),
        model=parallel_state.get_model_parallel_rank(),
        tensor_src=parallel_state.get_tensor_model_parallel_src_rank(),
        data_src=parallel_state.get_data_parallel_src_rank(),
        first=parallel_state.is_pipeline_first_stage(),
        last=parallel_state.is_pipeline_last_stage(),
        next=parallel_state.get_pipeline_model_parallel_next_rank(),
        prev=parallel_state.get_pipeline_model_parallel_prev_rank())
    return out


def _gather_grad(param):
    """The full gradient of a sharded parameter (all-gathered along its partition dim)."""
    parts = [torch.empty_like(param.grad) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, param.grad.contiguous())
    return torch.cat(parts, dim=param.partition_dim)


def layers(rank, world_size, inputs):
    """Each parallel layer with full weights from `inputs`: outputs and all gradients."""
    parallel_state.initialize_model_parallel(world_size, 1)
    tp = TensorParallel.of_this_process()
    mine = dict(rank=tp.rank, size=tp.size)
    out = {}
    x, w_col, w_row, table, ids = (inputs[k] for k in ("x", "w_col", "w_row", "table", "ids"))
    for gather in (True, False):
        col = ColumnParallelLinear(w_col.shape[1], w_col.shape[0], tp=tp, bias=True,
                                   gather_output=gather)
        with torch.no_grad():
            col.weight.copy_(shard(w_col, 0, 1, **mine))
            col.bias.copy_(shard(inputs["b_col"], 0, 1, **mine))
        xi = x.clone().requires_grad_()
        y = col(xi)
        if not gather:
            y = gather_from_tensor_model_parallel_region(y, tp)
        (y * inputs["dy_col"]).sum().backward()
        out[f"col{gather}"] = (y.detach(), xi.grad, _gather_grad(col.weight),
                               _gather_grad(col.bias))
    for parallel_input in (True, False):
        row = RowParallelLinear(w_row.shape[1], w_row.shape[0], tp=tp, bias=True,
                                input_is_parallel=parallel_input)
        with torch.no_grad():
            row.weight.copy_(shard(w_row, 1, 1, **mine))
            row.bias.copy_(inputs["b_row"])
        hi = inputs["h"].clone().requires_grad_()
        y = row(shard(hi, -1, 1, **mine) if parallel_input else hi)
        (y * inputs["dy_row"]).sum().backward()
        out[f"row{parallel_input}"] = (y.detach(), hi.grad, _gather_grad(row.weight),
                                       row.bias.grad)
    emb = VocabParallelEmbedding(*table.shape, tp=tp)
    with torch.no_grad():
        emb.weight.copy_(shard(table, 0, 1, **mine))
    y = emb(ids)
    (y * inputs["dy_emb"]).sum().backward()
    out["embedding"] = (y.detach(), _gather_grad(emb.weight))
    logits = shard(inputs["logits"], -1, 1, **mine).clone().requires_grad_()
    for smoothing in (0.0, 0.1):
        logits.grad = None
        loss = vocab_parallel_cross_entropy(logits, inputs["target"], inputs["vocab"],
                                            label_smoothing=smoothing, tp=tp)
        (loss * inputs["dloss"]).sum().backward()
        grad = [torch.empty_like(logits.grad) for _ in range(world_size)]
        dist.all_gather(grad, logits.grad.contiguous())
        out[f"xent{smoothing}"] = (loss.detach(), torch.cat(grad, -1))
    return out


def model_step(rank, world_size, fields, full_state, batch, options):
    """Loss, gathered logits and full gradients of the model at this TP size."""
    parallel_state.initialize_model_parallel(world_size, 1)
    seed(options.get("seed", 1234))
    model = T5Model(T5Config(**fields), attention_backend=options.get("backend", "auto"),
                    checkpoint_activations=options.get("checkpoint", False))
    load_full_state_dict(model, full_state)
    model.train(options.get("train", False))
    runs = []
    for _ in range(options.get("repeats", 1)):
        seed(options.get("seed", 1234))
        model.zero_grad(set_to_none=True)
        out = model(*batch)
        out.loss.backward()
        logits = gather_from_tensor_model_parallel_region(out.logits.detach(),
                                                          model.tensor_parallel)
        runs.append((out.loss.detach(), logits[..., :fields["vocab_size"]],
                     gather_full_state_dict(model, grads=True)))
    result = {"runs": runs if rank == 0 else None}
    if options.get("deepspeed_norm"):
        result["deepspeed_norm"] = _deepspeed_grad_norm(model)
    return result


def _deepspeed_grad_norm(model):
    """DeepSpeed's own clip_grad_norm_ with our parallel_state as its mpu."""
    import deepspeed
    from deepspeed.runtime.utils import clip_grad_norm_

    deepspeed.init_distributed(dist_backend="gloo")
    return float(clip_grad_norm_(list(model.parameters()), max_norm=1e9,
                                 mpu=parallel_state))


def dropout_streams(rank, world_size, tp):
    """Draws from the tracker stream and the default stream on every rank."""
    parallel_state.initialize_model_parallel(tp, 1)
    seed(42)
    with get_cuda_rng_tracker().fork():
        tracked = torch.rand(6)
    default = torch.rand(6)
    return tracked, default, parallel_state.get_tensor_model_parallel_rank(), \
        parallel_state.get_data_parallel_rank()


def zero_init_weights(rank, world_size, tp, fields):
    """Largest difference between a model built under deepspeed.zero.Init (gathered) and one
    built normally from the same seed, per parameter."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    parallel_state.initialize_model_parallel(tp, 1)
    seed(7)
    reference = dict(T5Model(T5Config(**fields)).named_parameters())
    dp = parallel_state.get_data_parallel_world_size()
    config = {"train_micro_batch_size_per_gpu": 1, "train_batch_size": dp,
              "zero_optimization": {"stage": 3}}
    seed(7)
    with deepspeed.zero.Init(config_dict_or_path=config, mpu=parallel_state,
                             data_parallel_group=parallel_state.get_data_parallel_group()):
        model = T5Model(T5Config(**fields))
    partitioned = all(p.numel() < reference[n].numel() for n, p in model.named_parameters()) \
        if dp > 1 else None
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        diffs = {n: (p.detach() - reference[n]).abs().max().item()
                 for n, p in model.named_parameters()}
    return diffs, partitioned


def built_shapes(rank, world_size, tp, fields, divisor):
    """{name: shape} of the model this rank builds for tensor parallelism `tp` (the groups'
    default, as a run builds it), and the tensor rank."""
    parallel_state.initialize_model_parallel(tp, 1)
    model = T5Model(T5Config(**fields), make_vocab_size_divisible_by=divisor)
    return ({name: tuple(p.shape) for name, p in model.named_parameters()},
            parallel_state.get_tensor_model_parallel_rank())
