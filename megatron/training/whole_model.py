"""The model validation's decoding runs on where the trained module is not a whole T5Model.

Validation's greedy decoding (training/finetune_metrics.py) runs megatron/generation's
`Decoder`, which calls the single-process model's own methods (encode, cross_key_values,
decode_step) and reads some weights directly (the shared embedding for tied logits, the relative
position bias tables), or, in a pipeline, its `PipelineDecoder` over each stage's part. Two
layouts do not hold such a model:

- ZeRO-3 partitions every parameter over the data-parallel ranks, and only a module's forward
  gathers its own (DeepSpeed's hooks), so the decoder's direct reads would see empty shards:
  `whole_model` gives a plain copy of this rank's tensor-parallel shard, each parameter
  gathered in turn (zero.GatheredParameters) and copied into the model
  megatron/pipeline/builder.py builds;
- a pipeline stage holds its own layers only (megatron/pipeline/module.py), as DeepSpeed's
  layers: `stage_model` gives, on every rank, the stage generation decodes with
  (megatron/generation/stage.py), built by the same builder with the trained stage's own
  tensors under their single-process names (pipeline/module.py's `single_process_names`);
  the stages then decode together, as `python -m megatron.generate` does.

A copy costs this rank the memory of its unpartitioned tensor-parallel shard (ZeRO-3: of the
model; in a pipeline: of its stage) while the decoding runs (docs/finetuning.md). It is built
uninitialised (no weights drawn) and draws nothing from the run's random generators.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from megatron.deepspeed_internals import is_zero3_parameter
from megatron.generation.stage import PipelineStage
from megatron.model.t5 import T5Model
from megatron.pipeline.builder import model_from_tensors
from megatron.pipeline.partition import Cut
from megatron.tensor_parallel.group import TensorParallel


def _gathered(module: T5Model):
    """(name, this rank's tensor-parallel shard) of each parameter of a ZeRO-3 module, each
    valid until the next is asked for, then its persistent buffers."""
    import deepspeed

    for name, param in module.named_parameters():
        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            yield name, param.data
    yield from module.named_buffers()


def _zero3_copy(module: T5Model, make_vocab_size_divisible_by: int, attention_backend: str,
                device) -> T5Model:
    prompt = getattr(module, "prompt", None)
    return model_from_tensors(
        module.config, _gathered(module), sharded=True,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by, backend=attention_backend,
        tp=module.tensor_parallel, ep=module.expert_parallel, device=device,
        dtype=next(module.parameters()).dtype,
        prompt_layout=None if prompt is None else prompt.layout)


def stage_model(module, cut: Cut, make_vocab_size_divisible_by: int,
                attention_backend: str) -> PipelineStage:
    """This rank's pipeline stage of the trained pipeline module `module` (cut by `cut`, the
    run's), in evaluation mode, for megatron/generation/pipeline.py's `PipelineDecoder`: a
    copy of the stage's tensors (module docstring). Called on every rank of the pipeline."""
    from megatron.generation.stage import build_stage, pipeline_of_this_process
    from megatron.pipeline.module import single_process_buffer_names, single_process_names

    names = single_process_names(module)
    names.update(single_process_buffer_names(module))
    state = module.state_dict(keep_vars=True)
    stage, ranks, group = pipeline_of_this_process()
    first = next(module.parameters())
    return build_stage(module.config, cut, stage,
                       ((single, state[local].detach()) for local, single in names.items()),
                       make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                       backend=attention_backend, tp=TensorParallel.of_this_process(),
                       ep=module.expert_parallel, device=first.device, dtype=first.dtype,
                       ranks=ranks, group=group, sharded=True)


def needs_copy(module) -> bool:
    """Whether `module` (a trained module) is not a whole T5Model on this rank."""
    return not isinstance(module, T5Model) or \
        any(is_zero3_parameter(p) for p in module.parameters())


@contextmanager
def whole_model(module, make_vocab_size_divisible_by: int,
                attention_backend: str) -> Iterator[T5Model]:
    """`module` itself where it is a whole T5Model; under ZeRO-3 a copy (module docstring),
    dropped on exit. A pipeline's module: `stage_model`."""
    if not needs_copy(module):
        yield module
        return
    if not isinstance(module, T5Model):
        raise TypeError("a pipeline stage's module: decode with stage_model")
    device = next(module.parameters()).device
    copy = _zero3_copy(module, make_vocab_size_divisible_by, attention_backend, device)
    try:
        yield copy
    finally:
        del copy
