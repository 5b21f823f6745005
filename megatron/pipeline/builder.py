"""The one builder of a T5Model from tensors: whole, or one pipeline stage's part, at any
tensor- and expert-parallel size.

Its users: `python -m megatron.generate` (whole or a stage, from a checkpoint's full tensors),
generation/stage.py (a decoding stage), training/whole_model.py (validation's decoding under
ZeRO-3 and in a pipeline, from the trained module's own shards), and whoever else holds a
model's tensors by their single-process names.

A stage's model is a `T5Model` built on the meta device (no memory, no initialization) whose
parts the stage holds (`Cut.stage_modules`, from the stage plan in partition.py) are then built
with the model's own builders (model/t5.py: build_block, shared_embedding, final_layer_norm,
untied_lm_head; transformer.py: relative_attention_bias) and put in their places, so every name
is the single-process model's and the T5Model methods run on the parts that are there.

How the parts get their memory:

- from full tensors (a checkpoint's, any saved layout): built on the device, each part drawing
  its weights as the single-process model does, then overwritten by the tensors split for the
  tensor- and expert-parallel size (model/state_dict.py's `load_full_state_dict`, which reads
  the parameters' tensor-parallel attributes to split them);
- from this rank's shards (`sharded=True`: a trained module's own tensors): built on the meta
  device and given uninitialised memory (no weights drawn, no time spent), every parameter and
  buffer then copied from the shards, all of them required. `nn.Module.to_empty` makes new
  Parameter objects and so drops the attributes the tensor-parallel layers set on theirs
  (`tensor_model_parallel`, `partition_dim`, `partition_stride`, `expert_parallel`, ...), which
  say how a full tensor is split; `_materialize` puts them back, so a model built either way
  carries them (tests/generation/test_builder.py).

Building draws no number from the process's random generators (the run's dropout and sampling
streams go on as if no model had been built): the parts draw from streams of their own
(tensor_parallel/random.init_rng) and a prompt's draw is undone.
"""

from __future__ import annotations

from typing import Iterable, Optional, Tuple

import torch
from torch import nn

from megatron.model.config import T5Config
from megatron.model.prompt import PromptEncoder, PromptLayout
from megatron.model.state_dict import StateDictError, load_full_state_dict
from megatron.model.t5 import (
    T5Model,
    build_block,
    final_layer_norm,
    shared_embedding,
    untied_lm_head,
)
from megatron.model.transformer import InitMethods, relative_attention_bias
from megatron.pipeline.partition import BIAS_TABLE, Cut
from megatron.tensor_parallel.group import ExpertParallel, TensorParallel

Tensors = Iterable[Tuple[str, torch.Tensor]]


def build_model(config: T5Config, *, make_vocab_size_divisible_by: int, backend: str,
                tp: TensorParallel, ep: ExpertParallel, device, dtype, cut: Optional[Cut] = None,
                stage: int = 0, prompt_layout: Optional[PromptLayout] = None,
                initialize: bool = True) -> T5Model:
    """The whole model (`cut` None) or stage `stage` of `cut` (its parts on `device`, the rest
    on the meta device), this rank's tensor- and expert-parallel shard, in training mode as
    nn.Module leaves it. `prompt_layout`: a tuned prompt (megatron/model/prompt.py), attached
    where the encoder input is embedded (the whole model, or stage 0). `initialize`: the
    weights drawn as the single-process model draws them; False: uninitialised memory (to be
    filled), the parameters' attributes kept (module docstring)."""
    where = device if initialize else "meta"
    with torch.random.fork_rng(devices=[]):  # (PromptEncoder draws from the default stream)
        model = T5Model(config, make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                        attention_backend=backend, device=where if cut is None else "meta",
                        dtype=dtype, tensor_parallel=tp, expert_parallel=ep)
        if cut is None:
            parts = [model]
        else:
            parts = []
            for name in cut.stage_modules(stage, config.tie_word_embeddings):
                parts.append(_build_part(name, model, backend, where, dtype))
                model.set_submodule(name, parts[-1])
        if prompt_layout is not None and (cut is None or stage == 0):
            model.prompt = PromptEncoder(prompt_layout, config.d_model, device=where,
                                         dtype=dtype)
            parts.append(model.prompt)
    if not initialize:
        for part in parts:
            _materialize(part, device)
    return model


def _build_part(name: str, model: T5Model, backend: str, device, dtype) -> nn.Module:
    """Module `name` of `model` (a `Cut.stage_modules` name), built on `device` by the
    single-process model's builder."""
    config, tp, ep = model.config, model.tensor_parallel, model.expert_parallel
    stack, _, rest = name.partition(".")
    decoder = stack == "decoder"
    if name == "shared":
        return shared_embedding(config, model.padded_vocab_size, tp, device, dtype)
    if name == "lm_head":
        return untied_lm_head(config, model.padded_vocab_size, tp, device, dtype)
    if rest == "final_layer_norm":
        return final_layer_norm(config, device, dtype)
    if rest == BIAS_TABLE:
        layers = config.num_decoder_layers if decoder else config.num_layers
        return relative_attention_bias(config, InitMethods(config, layers), decoder, tp,
                                       device, dtype)
    index = int(rest.removeprefix("block."))
    return build_block(config, decoder, index, backend, tp, device=device, dtype=dtype, ep=ep)


def _materialize(module: nn.Module, device) -> None:
    """`module`'s meta tensors given uninitialised memory on `device`, each parameter keeping
    the attributes set on it (to_empty alone makes new Parameters without them)."""
    attributes = {name: dict(vars(p)) for name, p in module.named_parameters()}
    module.to_empty(device=device)
    for name, param in module.named_parameters():
        vars(param).update(attributes[name])


def _held(model: nn.Module) -> Tuple[set, set]:
    """(names of the parameters, of the persistent buffers) `model` holds (not on the meta
    device: a stage's model holds its parts only)."""
    every = dict(model.named_parameters())
    params = {name for name, p in every.items() if not p.is_meta}
    buffers = {name for name, t in model.state_dict(keep_vars=True).items()
               if name not in every and not t.is_meta}
    return params, buffers


def load_tensors(model: T5Model, tensors: Tensors, *, sharded: bool = False) -> None:
    """`tensors` ((single-process name, tensor) pairs, consumed one at a time) into `model`.

    Full tensors (default): a whole model takes them all (model/state_dict.py's
    `load_full_state_dict`: strict); a stage keeps those of its parts and ignores the others.
    `sharded`: this rank's shards already (a trained module's, of the same tensor- and
    expert-parallel layout); each is copied while it is handed over (it may be valid for that
    moment only: a ZeRO-3 parameter gathered), the first of a repeated name wins (a tied
    module), names the model does not hold are ignored, and every parameter and buffer the
    model holds must come.

    Raises:
        StateDictError: names or shapes that do not fit, all listed.
    """
    params, buffers = _held(model)
    if sharded:
        _copy_shards(model, tensors, params | buffers)
        return
    partial = any(p.is_meta for p in model.parameters())
    full = {name: tensor for name, tensor in tensors
            if not partial or name in params or name in buffers}
    load_full_state_dict(model, full, held_only=partial)


def _copy_shards(model: nn.Module, tensors: Tensors, wanted: set) -> None:
    target = model.state_dict()
    filled, problems = set(), []
    with torch.no_grad():
        for name, tensor in tensors:
            if name not in wanted or name in filled:
                continue
            if tensor.numel() != target[name].numel():
                problems.append(f"{name}: shape {tuple(tensor.shape)} does not fit "
                                f"{tuple(target[name].shape)}")
                continue
            target[name].copy_(tensor.reshape(target[name].shape))
            filled.add(name)
    missing = sorted(wanted - filled)
    if missing:
        problems.insert(0, f"missing: {', '.join(missing)}")
    if problems:
        raise StateDictError("the tensors do not fit the model: " + "; ".join(problems))


def model_from_tensors(config: T5Config, tensors: Tensors, *, sharded: bool = False,
                       **build) -> T5Model:
    """`build_model(config, **build)` holding `tensors` (`load_tensors`), in evaluation mode.
    With `sharded` the model is built uninitialised: the shards fill all of it.

    Raises:
        StateDictError: the tensors do not fit the model (names or shapes, all listed).
    """
    model = build_model(config, initialize=not sharded, **build)
    load_tensors(model, tensors, sharded=sharded)
    return model.eval()
