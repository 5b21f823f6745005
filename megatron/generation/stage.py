"""A pipeline stage's part of the model, for generation at --pipeline-model-parallel-size > 1.

The stage's model is a `T5Model` built on the meta device (no memory, no initialization) whose
parts this stage runs are then built on the stage's device with the model's own builders
(model/t5.py: build_block, shared_embedding, final_layer_norm, untied_lm_head; the bias table
with transformer.py's relative_attention_bias) and put in their places, so every name is the
single-process model's and the T5Model methods run on the parts that are there. The cut is
training's (megatron/pipeline/partition.py, `cut_model`); a stage holds

    its encoder and decoder blocks (`Cut.stage_blocks`),
    the shared embedding: stage 0 (encoder input), the stage with decoder block 0 (decoder
        input) and, when the head is tied, the last stage,
    the encoder's final norm with the last encoder block; the decoder's, and the untied
        lm_head, on the last stage,
    each stack's relative position bias table (block 0's) where it holds blocks of the stack
        but not block 0 (block 0 stays on the meta device but for its table),
    a tuned prompt on stage 0 (the encoder's embedding; the grown encoder mask travels on).

Only those tensors of the checkpoint are kept (read as full tensors, split for the
tensor-parallel size: any saved layout).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Tuple

import torch
from torch import nn

from megatron.model.config import T5Config
from megatron.model.prompt import PromptEncoder
from megatron.model.state_dict import load_full_state_dict
from megatron.model.t5 import (
    T5Model,
    build_block,
    final_layer_norm,
    shared_embedding,
    untied_lm_head,
)
from megatron.model.transformer import InitMethods, relative_attention_bias
from megatron.pipeline.partition import Cut
from megatron.tensor_parallel.group import ExpertParallel, TensorParallel

BIAS_TABLE = "block.0.layer.0.SelfAttention.relative_attention_bias"
"""A stack's relative position bias table, under its stack's name."""


@dataclass
class PipelineStage:
    """This process's stage: `model` (its parts on `device`, the rest on the meta device), the
    cut, and the global ranks of its pipeline group's stages (`ranks[s]`: stage s)."""

    model: T5Model
    cut: Cut
    stage: int
    ranks: Tuple[int, ...]
    group: object
    device: torch.device

    @property
    def encoder_blocks(self) -> range:
        return self.cut.stage_blocks(self.stage)[0]

    @property
    def decoder_blocks(self) -> range:
        return self.cut.stage_blocks(self.stage)[1]

    @property
    def is_last(self) -> bool:
        return self.stage == self.cut.stages - 1

    @property
    def finishing_stage(self) -> int:
        """The stage with the last encoder block (it computes the encoder output)."""
        return next(s for s in range(self.cut.stages)
                    if self.cut.stage_blocks(s)[0].stop == self.cut.encoder_layers
                    and len(self.cut.stage_blocks(s)[0]))

    def decoder_stages(self) -> List[int]:
        """The stages holding decoder blocks (contiguous, up to the last)."""
        return [s for s in range(self.cut.stages) if len(self.cut.stage_blocks(s)[1])]

    def eval(self) -> "PipelineStage":
        self.model.eval()
        return self


def stage_parts(config: T5Config, cut: Cut, stage: int) -> List[str]:
    """The names of the modules `stage` holds (module docstring), in the model's order."""
    enc, dec = cut.stage_blocks(stage)
    last = stage == cut.stages - 1
    parts = []
    if stage == 0 or (len(dec) and dec.start == 0) or (last and config.tie_word_embeddings):
        parts.append("shared")
    if len(enc) and enc.start > 0:
        parts.append(f"encoder.{BIAS_TABLE}")
    parts += [f"encoder.block.{i}" for i in enc]
    if len(enc) and enc.stop == cut.encoder_layers:
        parts.append("encoder.final_layer_norm")
    if len(dec) and dec.start > 0:
        parts.append(f"decoder.{BIAS_TABLE}")
    parts += [f"decoder.block.{j}" for j in dec]
    if last:
        parts.append("decoder.final_layer_norm")
        if not config.tie_word_embeddings:
            parts.append("lm_head")
    return parts


def _build_part(name: str, model: T5Model, backend: str, device, dtype) -> nn.Module:
    """Module `name` of `model`, built on `device` by the single-process model's builder."""
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


def build_stage(config: T5Config, cut: Cut, stage: int, tensors: Iterable[Tuple[str,
                torch.Tensor]], *, make_vocab_size_divisible_by: int, backend: str,
                tp: TensorParallel, ep: ExpertParallel, device, dtype, ranks: Tuple[int, ...],
                group, prompt_layout=None) -> PipelineStage:
    """Stage `stage`'s model holding the weights of `tensors` ((name, full tensor) pairs, as
    megatron/checkpoint's iter_full_tensors yields them; only this stage's are kept), in
    evaluation mode. `prompt_layout`: a tuned prompt's (megatron/model/prompt.py), attached on
    stage 0, which embeds the encoder input (its `prompt.weight` among `tensors`).

    Raises:
        StateDictError: the tensors do not fit this stage's parts (names or shapes).
    """
    model = T5Model(config, make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                    attention_backend=backend, device="meta", dtype=dtype, tensor_parallel=tp,
                    expert_parallel=ep)
    for name in stage_parts(config, cut, stage):
        model.set_submodule(name, _build_part(name, model, backend, device, dtype))
    if prompt_layout is not None and stage == 0:
        model.prompt = PromptEncoder(prompt_layout, config.d_model, device=device, dtype=dtype)
    held = {name for name, p in model.named_parameters() if not p.is_meta}
    held |= {name for name, b in model.named_buffers() if not b.is_meta}
    full = {name: tensor for name, tensor in tensors if name in held}
    load_full_state_dict(model, full, held_only=True)
    return PipelineStage(model.eval(), cut, stage, tuple(ranks), group, torch.device(device))


def pipeline_of_this_process() -> Tuple[int, Tuple[int, ...], object]:
    """(this process's stage, the global ranks of its pipeline group's stages, the group),
    from megatron.parallel_state (initialized)."""
    from megatron import parallel_state

    layout = parallel_state.get_layout()
    ranks = tuple(layout.global_rank(layout.tensor_rank, layout.data_rank, p)
                  for p in range(layout.pipeline_size))
    return layout.pipeline_rank, ranks, parallel_state.get_pipeline_model_parallel_group()
