"""The T5 encoder-decoder as a DeepSpeed PipelineModule, cut by partition.py.

Every stage builds only its own layers (LayerSpec / TiedLayerSpec), each drawing its weights from
the stream that the single-process model uses for it (tensor_parallel.random.init_rng), so a
pipeline of any cut starts from the same weights as one process.

What crosses a stage is a tuple of tensors whose fields each layer knows statically
(`fields_in`, `fields_out`; DeepSpeed sends tuples, not dicts or None):

    enc_ids, dec_ids        int64 ids (the decoder's ride through the encoder stages)
    enc_mask, dec_mask      int64 0/1 attention masks; each stage makes its additive masks
    hidden                  the current stack's activations
    encoder_output          from finish_encoder to the last decoder block

DeepSpeed makes every received floating tensor require a gradient and sends one back for each,
so a floating field leaves the tuple as soon as no later layer reads it: `encoder_output` after
the last decoder block, `position_bias` at the end of every stage. The relative position bias
(batch x heads x L x L) is never sent: each stage holding blocks of a stack has that stack's
small bucket table (tied across those stages, like the shared embedding across the first stage,
the first decoder stage and the LM head) and computes the bias itself.

Tied weights: DeepSpeed sums their gradients over the stages that hold them (ReduceTiedGrads)
and marks the copies beyond the first `ds_pipe_replicated`, so gradient norms count them once.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from megatron.model.config import T5Config
from megatron.model.dropout import dropout
from megatron.model.t5 import (
    additive_decoder_mask,
    additive_encoder_mask,
    shared_embedding,
    untied_lm_head,
)
from megatron.model.transformer import (
    Carry,
    InitMethods,
    T5Block,
    T5LayerNorm,
    relative_attention_bias,
    relative_bias,
    stack_position_bias,
)
from megatron.pipeline.partition import Cut
from megatron.tensor_parallel.group import TensorParallel
from megatron.tensor_parallel.layers import parallel_lm_logits
from megatron.tensor_parallel.random import init_rng

INPUT_FIELDS = ("enc_ids", "dec_ids", "enc_mask", "dec_mask")
"""The first stage's input tuple (batch[0] of DeepSpeed's (inputs, labels) pairs)."""

FIELD_ORDER = ("hidden", "encoder_output", "position_bias", "enc_ids", "dec_ids", "enc_mask",
               "dec_mask")

LAYERS_FILE = "pipeline_layers.json"
"""Written into a pipeline checkpoint: each layer file's single-process name, the stage starts
and the tied modules' names (for the conversion tool)."""

SHARED_KEY = "shared"
BIAS_KEYS = {False: "encoder_relative_attention_bias", True: "decoder_relative_attention_bias"}
"""Tied-module keys; the names carry 'relative_attention_bias' so that the parameter groups
(training/engine.py) exempt them from weight decay as in the single-process model."""


Fields = Dict[str, torch.Tensor]


class _Fields(nn.Module):
    """A layer that reads a tuple as named fields and writes back `fields_out`."""

    def __init__(self, fields_in: Sequence[str], fields_out: Sequence[str]) -> None:
        super().__init__()
        self.fields_in, self.fields_out = tuple(fields_in), tuple(fields_out)

    def forward(self, inputs):
        fields = dict(zip(self.fields_in, inputs if isinstance(inputs, tuple) else (inputs,)))
        self.apply_fields(fields)
        return tuple(fields[k] for k in self.fields_out)

    def apply_fields(self, fields: Fields) -> None:
        raise NotImplementedError


class _TiedCall:
    """forward_fn of a TiedLayerSpec: DeepSpeed calls it with (tied module, inputs)."""

    def __init__(self, fields_in: Sequence[str], fields_out: Sequence[str],
                 apply: Callable[[nn.Module, Fields], None]) -> None:
        self.fields_in, self.fields_out, self.apply = tuple(fields_in), tuple(fields_out), apply

    def __call__(self, module: nn.Module, inputs):
        fields = dict(zip(self.fields_in, inputs if isinstance(inputs, tuple) else (inputs,)))
        out = self.apply(module, fields)
        if out is not None:  # the head returns the logits alone
            return out
        return tuple(fields[k] for k in self.fields_out)


# Modules built by the specs (each under the init stream of its single-process counterpart) --
class SharedEmbeddingPipe(nn.Module):
    """The shared embedding, on every stage that embeds or (tied) projects to the vocabulary."""

    def __init__(self, config: T5Config, padded_vocab_size: int, tp: TensorParallel,
                 device=None, dtype=None):
        super().__init__()
        with init_rng("shared"):
            self.embedding = shared_embedding(config, padded_vocab_size, tp, device, dtype)


class RelativeBiasPipe(nn.Module):
    """A stack's bucket table (tied over the stages that hold the stack's blocks)."""

    def __init__(self, config: T5Config, is_decoder: bool, tp: TensorParallel, device=None,
                 dtype=None):
        super().__init__()
        layers = config.num_decoder_layers if is_decoder else config.num_layers
        self.table = relative_attention_bias(config, InitMethods(config, layers), is_decoder,
                                             tp, device, dtype)
        self.config, self.is_decoder = config, is_decoder


class BlockPipe(_Fields):
    """Block `index` of a stack (without the bias table; the stage's RelativeBiasPipe computes
    the bias)."""

    def __init__(self, config: T5Config, is_decoder: bool, index: int, backend: str,
                 fields_in, fields_out, tp: TensorParallel, device=None, dtype=None) -> None:
        super().__init__(fields_in, fields_out)
        stack = "decoder" if is_decoder else "encoder"
        layers = config.num_decoder_layers if is_decoder else config.num_layers
        with init_rng(f"{stack}.block.{index}"):
            self.block = T5Block(config, InitMethods(config, layers), is_decoder,
                                 has_relative_attention_bias=False, backend=backend, tp=tp,
                                 device=device, dtype=dtype)
        self.is_decoder, self.index = is_decoder, index

    def apply_fields(self, fields: Fields) -> None:
        encoder_mask = additive_encoder_mask(fields["enc_mask"]) if self.is_decoder else None
        carry = Carry(hidden=fields["hidden"], encoder_output=fields.get("encoder_output"),
                      encoder_mask=encoder_mask, decoder_mask=None,
                      position_bias=fields["position_bias"], decoder_input_ids=None)
        fields["hidden"] = self.block(carry).hidden


class FinalNormPipe(_Fields):
    """A stack's final layer norm and dropout (the decoder's scaled when the config says so)."""

    def __init__(self, config: T5Config, is_decoder: bool, fields_in, fields_out, device=None,
                 dtype=None) -> None:
        super().__init__(fields_in, fields_out)
        self.final_layer_norm = T5LayerNorm(config.d_model, config.layer_norm_epsilon, device,
                                            dtype)
        self.config, self.is_decoder = config, is_decoder

    def apply_fields(self, fields: Fields) -> None:
        hidden = dropout(self.final_layer_norm(fields["hidden"]), self.config.dropout_rate,
                         self.training)
        if self.is_decoder:
            if self.config.scale_decoder_outputs:
                hidden = hidden * (self.config.d_model ** -0.5)
            fields["hidden"] = hidden
        else:
            del fields["hidden"]
            fields["encoder_output"] = hidden


class LMHeadPipe(nn.Module):
    """The untied LM head: logits of this tensor rank's vocabulary slice."""

    def __init__(self, config: T5Config, padded_vocab_size: int, fields_in, tp: TensorParallel,
                 device=None, dtype=None) -> None:
        super().__init__()
        with init_rng("lm_head"):
            self.lm_head = untied_lm_head(config, padded_vocab_size, tp, device, dtype)
        self.fields_in = tuple(fields_in)

    def forward(self, inputs):
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        return self.lm_head(dict(zip(self.fields_in, inputs))["hidden"])


# Tied forward functions ----------------------------------------------------------------------
def _embed(field: str, rate: float):
    def apply(module: SharedEmbeddingPipe, fields: Fields) -> None:
        fields["hidden"] = dropout(module.embedding(fields.pop(field)), rate, module.training)
    return apply


def _bias(module: RelativeBiasPipe, fields: Fields) -> None:
    hidden = fields["hidden"]
    if module.is_decoder:
        mask = additive_decoder_mask(fields["dec_mask"], hidden.shape[0], hidden.shape[1],
                                     hidden.device)
    else:
        mask = additive_encoder_mask(fields["enc_mask"])
    fields["position_bias"] = stack_position_bias(
        lambda q, k: relative_bias(module.table, module.config, module.is_decoder, q, k), mask,
        hidden)


def _tied_logits(module: SharedEmbeddingPipe, fields: Fields) -> torch.Tensor:
    return parallel_lm_logits(fields["hidden"], module.embedding)


# The layer list ------------------------------------------------------------------------------
def _ordered(fields) -> Tuple[str, ...]:
    return tuple(k for k in FIELD_ORDER if k in fields)


def pipeline_specs(config: T5Config, cut: Cut, padded_vocab_size: int, attention_backend: str,
                   tp: TensorParallel, device=None, dtype=None
                   ) -> Tuple[list, List[int], List[str]]:
    """(DeepSpeed layer specs, stage boundaries in that list, each spec's name), each layer
    built for the tensor-parallel share `tp`.

    Names say what a layer is in the single-process model ('shared', 'encoder.block.3', ...)."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    specs, names, parts = [], [], [0]
    fields = set(INPUT_FIELDS)
    kw = dict(device=device, dtype=dtype)
    tkw = dict(tp=tp, **kw)
    rate = config.dropout_rate

    def add(spec, name, out):
        specs.append(spec)
        names.append(name)
        return set(out)

    def flow(after: set, last_in_stage: bool) -> Tuple[str, ...]:
        return _ordered(after - {"position_bias"} if last_in_stage else after)

    for stage in range(cut.stages):
        enc, dec = cut.stage_blocks(stage)
        plan: List[tuple] = []  # (kind, argument) in order; fields worked out below
        if stage == 0:
            plan.append(("embed_encoder", None))
        if len(enc):
            plan.append(("bias", False))
            plan += [("block", (False, i)) for i in enc]
            if enc.stop == cut.encoder_layers:
                plan.append(("finish", False))
        if len(dec):
            if dec.start == 0:
                plan.append(("embed_decoder", None))
            plan.append(("bias", True))
            plan += [("block", (True, j)) for j in dec]
        if stage == cut.stages - 1:
            plan += [("finish", True), ("head", None)]
        for n, (kind, arg) in enumerate(plan):
            last = n == len(plan) - 1
            fin = _ordered(fields)
            if kind in ("embed_encoder", "embed_decoder"):
                ids = "enc_ids" if kind == "embed_encoder" else "dec_ids"
                out = flow(fields - {ids} | {"hidden"}, last)
                fields = add(TiedLayerSpec(SHARED_KEY, SharedEmbeddingPipe, config,
                                           padded_vocab_size, forward_fn=_TiedCall(
                                               fin, out, _embed(ids, rate)),
                                           tied_weight_attr=["embedding.weight"], **tkw),
                             "shared", out)
            elif kind == "bias":
                out = flow(fields | {"position_bias"}, last)
                stack = "decoder" if arg else "encoder"
                fields = add(TiedLayerSpec(BIAS_KEYS[arg], RelativeBiasPipe, config, arg,
                                           forward_fn=_TiedCall(fin, out, _bias),
                                           tied_weight_attr=["table.weight"], **tkw),
                             f"{stack}.relative_attention_bias", out)
            elif kind == "block":
                is_decoder, index = arg
                after = set(fields)
                if is_decoder and index == cut.decoder_layers - 1:
                    after -= {"encoder_output", "enc_mask", "dec_mask"}
                out = flow(after, last)
                stack = "decoder" if is_decoder else "encoder"
                fields = add(LayerSpec(BlockPipe, config, is_decoder, index, attention_backend,
                                       fin, out, **tkw), f"{stack}.block.{index}", out)
            elif kind == "finish":
                after = fields - {"position_bias"}
                if not arg:
                    after = after - {"hidden"} | {"encoder_output"}
                out = flow(after, last)
                stack = "decoder" if arg else "encoder"
                fields = add(LayerSpec(FinalNormPipe, config, arg, fin, out, **kw),
                             f"{stack}.final_layer_norm", out)
            else:  # head
                if config.tie_word_embeddings:
                    add(TiedLayerSpec(SHARED_KEY, SharedEmbeddingPipe, config, padded_vocab_size,
                                      forward_fn=_TiedCall(fin, (), _tied_logits),
                                      tied_weight_attr=["embedding.weight"], **tkw), "shared",
                        ())
                else:
                    add(LayerSpec(LMHeadPipe, config, padded_vocab_size, fin, **tkw), "lm_head",
                        ())
        parts.append(len(specs))
    return specs, parts, names


def build_pipeline_module(config: T5Config, cut: Cut, topology, padded_vocab_size: int,
                          attention_backend: str, loss_fn, checkpoint_activations: bool,
                          checkpoint_num_layers: int, device=None, dtype=None,
                          tensor_parallel: Optional[TensorParallel] = None):
    """This stage's part of the model as a DeepSpeed PipelineModule (collective: it creates
    the tied-weight groups and broadcasts the tied weights). tensor_parallel: as T5Model's
    (default: this process's, read here and nowhere below)."""
    from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
    from deepspeed.pipe import PipelineModule

    from megatron.tensor_parallel.random import checkpoint

    tp = tensor_parallel or TensorParallel.of_this_process()
    specs, parts, names = pipeline_specs(config, cut, padded_vocab_size, attention_backend, tp,
                                         device, dtype)

    class T5PipelineModule(PipelineModule):
        """PipelineModule with our cut (DeepSpeed's own partition methods know no encoder and
        decoder)."""

        def _partition_layers(self, method="uniform"):
            self.parts = list(parts)
            stage = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

        # DeepSpeed saves a stage's layers that are modules; a TiedLayerSpec with a forward_fn
        # is a functools.partial there, so the tied modules (the shared embedding, the bias
        # tables) would be neither saved nor loaded. Their first owner writes them.
        def _tied_path(self, folder, key):
            rank = self._grid._topo.get_rank_repr(rank=self.global_rank)
            return os.path.join(folder, f"tied_{key}" + (f"-{rank}" if rank else "")
                                + "-model_states.pt")

        def save_state_dict(self, save_dir, checkpoint_engine, exclude_frozen_params=False):
            super().save_state_dict(save_dir, checkpoint_engine, exclude_frozen_params)
            if self._grid.data_parallel_id != 0:
                return
            for key, tied in self.tied_modules.items():
                comm = self.tied_comms.get(key)
                if comm is None or self.global_rank == min(comm["ranks"]):
                    # a view into ZeRO's flat buffer would save the whole buffer: clone
                    state = clone_tensors_for_torch_save(tied.state_dict())
                    checkpoint_engine.save(state_dict=state, path=self._tied_path(save_dir, key))
            if self.global_rank == 0:
                with open(os.path.join(save_dir, LAYERS_FILE), "w", encoding="utf-8") as f:
                    json.dump({"layers": names, "stage_starts": parts,
                               "tied": tied_names()}, f, indent=1)

        def load_state_dir(self, load_dir, checkpoint_engine, strict=True):
            for key, tied in self.tied_modules.items():  # one file per tensor rank
                tied.load_state_dict(checkpoint_engine.load(self._tied_path(load_dir, key),
                                                            map_location="cpu"), strict=strict)
            super().load_state_dir(load_dir, checkpoint_engine, strict)

        def _synchronize_tied_weights(self):
            # DeepSpeed broadcasts into parameters that require grad; outside no_grad autograd
            # records the in-place collective and warns in every backward.
            with torch.no_grad():
                super()._synchronize_tied_weights()

    module = T5PipelineModule(
        specs, topology=topology, loss_fn=loss_fn, partition_method="uniform",
        activation_checkpoint_interval=checkpoint_num_layers if checkpoint_activations else 0,
        # ours replays the tensor-parallel RNG tracker too (DeepSpeed's tracks its own)
        activation_checkpoint_func=checkpoint, checkpointable_layers=["BlockPipe"])
    module.layer_names = names
    return module


def tied_names() -> Dict[str, str]:
    """{tied-module key: the single-process parameter it holds}."""
    bias = "block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    return {SHARED_KEY: "shared.weight", BIAS_KEYS[False]: f"encoder.{bias}",
            BIAS_KEYS[True]: f"decoder.{bias}"}


def single_process_names(module) -> Dict[str, str]:
    """{this stage's parameter name: the single-process T5Model's name} (Hugging Face names),
    for comparing a pipeline with one process and, later, for converting checkpoints."""
    out = {}
    for name, _ in module.named_parameters():
        head, _, rest = name.partition(".")
        if head == "tied_modules":
            out[name] = tied_names()[rest.partition(".")[0]]
            continue
        layer = module.layer_names[int(head)]
        if layer == "lm_head":
            out[name] = "lm_head.weight"
        elif ".block." in layer:
            out[name] = layer + rest[len("block"):]
        else:  # final norms: 'encoder.final_layer_norm' holds 'final_layer_norm.weight'
            out[name] = f"{layer.rpartition('.')[0]}.{rest}"
    return out
