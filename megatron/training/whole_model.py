"""A whole T5Model for decoding during training where the trained module is not whole on a rank.

Validation's greedy decoding (training/finetune_metrics.py) runs megatron/generation's
`Decoder`, which calls the single-process model's own methods (encode, cross_key_values,
decode_step) and reads some weights directly (the shared embedding for tied logits, the relative
position bias tables). Two layouts do not hold such a model:

- ZeRO-3 partitions every parameter over the data-parallel ranks, and only a module's forward
  gathers its own (DeepSpeed's hooks), so the decoder's direct reads would see empty shards;
- a pipeline stage holds its own layers only (megatron/pipeline/module.py).

`whole_model` then gives a plain copy of this rank's tensor-parallel shard, on the training
device, for the duration of the decoding: under ZeRO-3 on every rank, each parameter gathered
in turn (zero.GatheredParameters); in a pipeline on the first stage's ranks, which hold the
validation data, each later stage sending its parameters and persistent buffers there by their
single-process names (pipeline/module.py's `single_process_names`). The copy costs this rank the
memory of one unpartitioned tensor-parallel shard of the model while the decoding runs
(docs/finetuning.md).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, Iterator, Optional

import torch
import torch.distributed as dist

from megatron.deepspeed_internals import is_zero3_parameter
from megatron.model.t5 import T5Model
from megatron.tensor_parallel.group import ExpertParallel, TensorParallel


def _empty_copy(config, make_vocab_size_divisible_by: int, attention_backend: str, device,
                dtype, tp: TensorParallel, ep: ExpertParallel, prompt=None) -> T5Model:
    """A T5Model of `config` for this rank's shards, its tensors allocated, not initialised."""
    copy = T5Model(config, make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                   attention_backend=attention_backend, device="meta", dtype=dtype,
                   tensor_parallel=tp, expert_parallel=ep)
    if prompt is not None:
        from megatron.model.prompt import attach_prompt

        attach_prompt(copy, prompt.layout)
    return copy.to_empty(device=device).eval()


def _zero3_copy(module: T5Model, make_vocab_size_divisible_by: int, attention_backend: str,
                device) -> T5Model:
    import deepspeed

    params = dict(module.named_parameters())
    dtype = next(iter(params.values())).dtype
    copy = _empty_copy(module.config, make_vocab_size_divisible_by, attention_backend, device,
                       dtype, module.tensor_parallel, module.expert_parallel, module.prompt)
    target = copy.state_dict()
    with torch.no_grad():
        for name, param in params.items():
            with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                target[name].copy_(param.data.reshape(target[name].shape))
        for name, buffer in module.named_buffers():
            if name in target:
                target[name].copy_(buffer)
    return copy


def _pipeline_copy(module, make_vocab_size_divisible_by: int, attention_backend: str,
                   device) -> Optional[T5Model]:
    """On the first stage's ranks the whole copy (None on the others, which send theirs)."""
    from megatron import parallel_state
    from megatron.pipeline.module import single_process_buffer_names, single_process_names

    group = parallel_state.get_pipeline_model_parallel_group()
    ranks = dist.get_process_group_ranks(group)
    first = parallel_state.is_pipeline_first_stage()
    names = single_process_names(module)
    names.update(single_process_buffer_names(module))
    own: Dict[str, torch.Tensor] = {}
    state = module.state_dict(keep_vars=True)
    for local, single in names.items():
        own.setdefault(single, state[local].detach())
    offers = [None] * len(ranks)
    dist.all_gather_object(offers, sorted(own), group=group)
    copy = None
    if first:
        dtype = next(module.parameters()).dtype
        copy = _empty_copy(module.config, make_vocab_size_divisible_by, attention_backend,
                           device, dtype, TensorParallel.of_this_process(),
                           module.expert_parallel)
        target = copy.state_dict()
    filled = set()
    with torch.no_grad():
        for stage, offered in enumerate(offers):
            for name in offered:
                if name in filled:  # (the tied embedding: its first holder's)
                    continue
                filled.add(name)
                if stage == 0:
                    if first:
                        target[name].copy_(own[name])
                elif first:
                    received = torch.empty_like(target[name])
                    dist.recv(received, src=ranks[stage], group=group)
                    target[name].copy_(received)
                elif ranks[stage] == dist.get_rank():
                    dist.send(own[name].contiguous(), dst=ranks[0], group=group)
    if first:
        missing = sorted(set(target) - filled)
        if missing:
            raise RuntimeError(f"the pipeline stages hold no {', '.join(missing[:3])}")
    return copy


def needs_copy(module) -> bool:
    """Whether `module` (a trained module) is not a whole T5Model on this rank."""
    return not isinstance(module, T5Model) or \
        any(is_zero3_parameter(p) for p in module.parameters())


@contextmanager
def whole_model(module, make_vocab_size_divisible_by: int,
                attention_backend: str) -> Iterator[Optional[T5Model]]:
    """`module` itself where it is a whole T5Model; else a copy (module docstring): under
    ZeRO-3 on every rank, in a pipeline on the first stage's ranks (None on the others). The
    copy is dropped on exit."""
    if not needs_copy(module):
        yield module
        return
    device = next(module.parameters()).device
    if isinstance(module, T5Model):
        copy = _zero3_copy(module, make_vocab_size_divisible_by, attention_backend, device)
    else:
        copy = _pipeline_copy(module, make_vocab_size_divisible_by, attention_backend, device)
    try:
        yield copy
    finally:
        del copy
