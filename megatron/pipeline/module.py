"""The T5 encoder-decoder as a DeepSpeed PipelineModule, cut by partition.py.

Every stage builds only its own layers (LayerSpec / TiedLayerSpec) with the single-process
model's own builders (model/t5.py: build_block, shared_embedding, final_layer_norm,
untied_lm_head; transformer.py: relative_attention_bias), each drawing its weights from the
stream the single-process model uses for it (tensor_parallel/random.init_rng), so a pipeline of
any cut starts from the same weights as one process.

Which layers a stage runs and what crosses between them is `Cut.layers` (partition.py, with the
fields of `WIRE_ORDER`): each layer here reads its `PipeLayer.fields_in` by name and passes on
its `fields_out`. The relative position bias (batch x heads x L x L) is never sent: each stage
holding blocks of a stack has that stack's small bucket table (tied across those stages, like
the shared embedding across the first stage, the first decoder stage and the LM head) and
computes it.

Tied weights: DeepSpeed sums their gradients over the stages that hold them (ReduceTiedGrads)
and marks the copies beyond the first `ds_pipe_replicated`, so gradient norms count them once.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from megatron.model.config import T5Config
from megatron.model.dropout import dropout
from megatron.model.state_dict import persistent_buffers
from megatron.model.t5 import (
    additive_decoder_mask,
    additive_encoder_mask,
    build_block,
    final_layer_norm,
    shared_embedding,
    untied_lm_head,
)
from megatron.model.transformer import (
    Carry,
    InitMethods,
    relative_attention_bias,
    relative_bias,
    stack_position_bias,
)
from megatron.pipeline.partition import BIAS_TABLE, Cut, PipeLayer
from megatron.tensor_parallel.group import NO_EXPERT_PARALLEL, ExpertParallel, TensorParallel
from megatron.tensor_parallel.layers import parallel_lm_logits
from megatron.tensor_parallel.random import checkpoint

LAYERS_FILE = "pipeline_layers.json"
"""Written into a pipeline checkpoint: each layer file's single-process name, the stage starts
and the tied modules' names (for the conversion tool)."""

SHARED_KEY = "shared"
BIAS_KEYS = {False: "encoder_relative_attention_bias", True: "decoder_relative_attention_bias"}
"""Tied-module keys; the names carry 'relative_attention_bias' so that the parameter groups
(training/engine.py) exempt them from weight decay as in the single-process model."""


Fields = Dict[str, torch.Tensor]


def _read(layer: PipeLayer, inputs) -> Fields:
    """The tuple DeepSpeed hands a layer, by the field names `Cut.layers` gave it."""
    return dict(zip(layer.fields_in, inputs if isinstance(inputs, tuple) else (inputs,)))


def _write(layer: PipeLayer, fields: Fields) -> tuple:
    return tuple(fields[k] for k in layer.fields_out)


class _Fields(nn.Module):
    """A layer that reads its tuple as named fields and passes on `layer.fields_out`."""

    def __init__(self, layer: PipeLayer) -> None:
        super().__init__()
        self.layer_fields = layer

    def forward(self, inputs):
        fields = _read(self.layer_fields, inputs)
        self.apply_fields(fields)
        return _write(self.layer_fields, fields)

    def apply_fields(self, fields: Fields) -> None:
        raise NotImplementedError


class _TiedCall:
    """forward_fn of a TiedLayerSpec: DeepSpeed calls it with (tied module, inputs)."""

    def __init__(self, layer: PipeLayer, apply: Callable[[nn.Module, Fields], None]) -> None:
        self.layer, self.apply = layer, apply

    def __call__(self, module: nn.Module, inputs):
        fields = _read(self.layer, inputs)
        out = self.apply(module, fields)
        if out is not None:  # the head returns the logits alone
            return out
        return _write(self.layer, fields)


# Modules built by the specs, with the single-process model's builders --------------------------
class SharedEmbeddingPipe(nn.Module):
    """The shared embedding, on every stage that embeds or (tied) projects to the vocabulary."""

    def __init__(self, config: T5Config, padded_vocab_size: int, tp: TensorParallel,
                 device=None, dtype=None):
        super().__init__()
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
    """Block `layer.index` of a stack (without the bias table; the stage's RelativeBiasPipe
    computes the bias)."""

    def __init__(self, config: T5Config, layer: PipeLayer, backend: str, tp: TensorParallel,
                 device=None, dtype=None, ep: ExpertParallel = NO_EXPERT_PARALLEL) -> None:
        super().__init__(layer)
        self.is_decoder = layer.stack == "decoder"
        self.block = build_block(config, self.is_decoder, layer.index, backend, tp,
                                 has_relative_attention_bias=False, device=device, dtype=dtype,
                                 ep=ep)

    def apply_fields(self, fields: Fields) -> None:
        encoder_mask = additive_encoder_mask(fields["enc_mask"]) if self.is_decoder else None
        aux = fields.get("aux_loss")
        carry = Carry(hidden=fields["hidden"], encoder_output=fields.get("encoder_output"),
                      encoder_mask=encoder_mask, decoder_mask=None,
                      position_bias=fields["position_bias"], decoder_input_ids=None,
                      aux_loss=None if aux is None else aux.reshape(()))
        carry = self.block(carry)
        fields["hidden"] = carry.hidden
        if "aux_loss" in self.layer_fields.fields_out:
            fields["aux_loss"] = wire_aux(carry.aux_loss, carry.hidden.device)


def wire_aux(aux: Optional[torch.Tensor], device) -> torch.Tensor:
    """The balancing losses as they travel (`WIRE_ORDER`): float32 [1]; zero in evaluation,
    where the experts add none."""
    if aux is None:
        return torch.zeros(1, dtype=torch.float32, device=device)
    return aux.float().reshape(1)


def _with_aux(logits: torch.Tensor, fields: Fields):
    """The head's output: the logits, and the balancing losses where the model has them."""
    aux = fields.get("aux_loss")
    return logits if aux is None else (logits, aux)


class FinalNormPipe(_Fields):
    """A stack's final layer norm and dropout (the decoder's scaled when the config says so)."""

    def __init__(self, config: T5Config, layer: PipeLayer, device=None, dtype=None) -> None:
        super().__init__(layer)
        self.final_layer_norm = final_layer_norm(config, device, dtype)
        self.config, self.is_decoder = config, layer.stack == "decoder"

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

    def __init__(self, config: T5Config, padded_vocab_size: int, layer: PipeLayer,
                 tp: TensorParallel, device=None, dtype=None) -> None:
        super().__init__()
        self.lm_head = untied_lm_head(config, padded_vocab_size, tp, device, dtype)
        self.layer_fields = layer

    def forward(self, inputs):
        fields = _read(self.layer_fields, inputs)
        return _with_aux(self.lm_head(fields["hidden"]), fields)


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


def _tied_logits(module: SharedEmbeddingPipe, fields: Fields):
    return _with_aux(parallel_lm_logits(fields["hidden"], module.embedding), fields)


# The layer list ------------------------------------------------------------------------------
def pipeline_specs(config: T5Config, cut: Cut, padded_vocab_size: int, attention_backend: str,
                   tp: TensorParallel, device=None, dtype=None,
                   ep: ExpertParallel = NO_EXPERT_PARALLEL
                   ) -> Tuple[list, List[int], List[str]]:
    """(DeepSpeed layer specs, stage boundaries in that list, each spec's name): one spec per
    layer of `cut.layers`, built for the tensor-parallel share `tp` (and the sparse blocks for
    the expert-parallel share `ep`).

    Names say what a layer is in the single-process model ('shared', 'encoder.block.3', ...)."""
    # DeepSpeed is imported where it runs: its import takes seconds and logs on stdout
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    specs, names, parts = [], [], [0]
    kw = dict(tp=tp, device=device, dtype=dtype)
    for stage in range(cut.stages):
        for layer in cut.stage_layers(stage):
            decoder = layer.stack == "decoder"
            if layer.kind == "embed":
                ids = "dec_ids" if decoder else "enc_ids"
                spec = TiedLayerSpec(SHARED_KEY, SharedEmbeddingPipe, config, padded_vocab_size,
                                     forward_fn=_TiedCall(layer, _embed(ids, config.dropout_rate)),
                                     tied_weight_attr=["embedding.weight"], **kw)
            elif layer.kind == "bias":
                spec = TiedLayerSpec(BIAS_KEYS[decoder], RelativeBiasPipe, config, decoder,
                                     forward_fn=_TiedCall(layer, _bias),
                                     tied_weight_attr=["table.weight"], **kw)
            elif layer.kind == "block":
                spec = LayerSpec(BlockPipe, config, layer, attention_backend, ep=ep, **kw)
            elif layer.kind == "final_norm":
                spec = LayerSpec(FinalNormPipe, config, layer, device=device, dtype=dtype)
            elif config.tie_word_embeddings:  # the head
                spec = TiedLayerSpec(SHARED_KEY, SharedEmbeddingPipe, config, padded_vocab_size,
                                     forward_fn=_TiedCall(layer, _tied_logits),
                                     tied_weight_attr=["embedding.weight"], **kw)
            else:
                spec = LayerSpec(LMHeadPipe, config, padded_vocab_size, layer, **kw)
            specs.append(spec)
            names.append(layer.owner(config.tie_word_embeddings))
        parts.append(len(specs))
    return specs, parts, names


def build_pipeline_module(config: T5Config, cut: Cut, topology, padded_vocab_size: int,
                          attention_backend: str, loss_fn, checkpoint_activations: bool,
                          checkpoint_num_layers: int, device=None, dtype=None,
                          tensor_parallel: Optional[TensorParallel] = None,
                          expert_parallel: Optional[ExpertParallel] = None):
    """This stage's part of the model as a DeepSpeed PipelineModule (collective: it creates
    the tied-weight groups and broadcasts the tied weights). tensor_parallel, expert_parallel:
    as T5Model's (default: this process's, read here and nowhere below); the module carries
    `config` and `expert_parallel` as T5Model does (training/experts.py reads them)."""
    from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
    from deepspeed.pipe import PipelineModule


    tp = tensor_parallel or TensorParallel.of_this_process()
    ep = expert_parallel or ExpertParallel.of_this_process()
    specs, parts, names = pipeline_specs(config, cut, padded_vocab_size, attention_backend, tp,
                                         device, dtype, ep)

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
            self.write_layers_file(save_dir)

        def write_layers_file(self, save_dir) -> None:
            """LAYERS_FILE, on global rank 0 (the conversion tool reads stage files by it)."""
            if self.global_rank == 0:
                with open(os.path.join(save_dir, LAYERS_FILE), "w", encoding="utf-8") as f:
                    json.dump({"layers": names, "stage_starts": parts,
                               "tied": tied_names()}, f, indent=1)

        def single_process_names(self) -> Dict[str, str]:
            """{parameter name here: the single-process T5Model's} (module function below)."""
            return single_process_names(self)

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
    module.config, module.expert_parallel = config, ep
    return module


def tied_names() -> Dict[str, str]:
    """{tied-module key: the single-process parameter it holds}."""
    bias = f"{BIAS_TABLE}.weight"
    return {SHARED_KEY: "shared.weight", BIAS_KEYS[False]: f"encoder.{bias}",
            BIAS_KEYS[True]: f"decoder.{bias}"}


def single_process_names(module) -> Dict[str, str]:
    """{this stage's parameter name: the single-process T5Model's name} (Hugging Face names),
    for comparing a pipeline with one process and, later, for converting checkpoints."""
    return {name: _single_process_name(module, name) for name, _ in module.named_parameters()}


def single_process_buffer_names(module) -> Dict[str, str]:
    """The same for this stage's persistent buffers (the experts' routing biases)."""
    return {name: _single_process_name(module, name) for name in persistent_buffers(module)}


def _single_process_name(module, name: str) -> str:
    head, _, rest = name.partition(".")
    if head == "tied_modules":
        return tied_names()[rest.partition(".")[0]]
    layer = module.layer_names[int(head)]
    if layer == "lm_head":
        return "lm_head.weight"
    if ".block." in layer:
        return layer + rest[len("block"):]
    # final norms: 'encoder.final_layer_norm' holds 'final_layer_norm.weight'
    return f"{layer.rpartition('.')[0]}.{rest}"
