"""A pipeline stage's part of the model, for generation at --pipeline-model-parallel-size > 1.

The stage's model is built by the one model builder (megatron/pipeline/builder.py): a
`T5Model` on the meta device whose parts this stage runs are built on the stage's device with
the model's own builders and put in their places, so every name is the single-process model's
and the T5Model methods run on the parts that are there. The cut is training's
(megatron/pipeline/partition.py, `cut_model`); a stage holds `Cut.stage_modules`:

    its encoder and decoder blocks (`Cut.stage_blocks`),
    the shared embedding: stage 0 (encoder input), the stage with decoder block 0 (decoder
        input) and, when the head is tied, the last stage,
    the encoder's final norm with the last encoder block; the decoder's, and the untied
        lm_head, on the last stage,
    each stack's relative position bias table (block 0's) where it holds blocks of the stack
        but not block 0 (block 0 stays on the meta device but for its table),
    a tuned prompt on stage 0 (the encoder's embedding; the grown encoder mask travels on).

Only those tensors of the checkpoint are kept (read as full tensors, split for the
tensor-parallel size: any saved layout), or, for validation's decoding during training, the
trained stage's own shards (training/whole_model.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Tuple

import torch

from megatron.model.config import T5Config
from megatron.model.t5 import T5Model
from megatron.pipeline.builder import model_from_tensors
from megatron.pipeline.partition import Cut
from megatron.tensor_parallel.group import ExpertParallel, TensorParallel


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


def build_stage(config: T5Config, cut: Cut, stage: int, tensors: Iterable[Tuple[str,
                torch.Tensor]], *, make_vocab_size_divisible_by: int, backend: str,
                tp: TensorParallel, ep: ExpertParallel, device, dtype, ranks: Tuple[int, ...],
                group, prompt_layout=None, sharded: bool = False) -> PipelineStage:
    """Stage `stage`'s model holding the weights of `tensors` ((name, full tensor) pairs, as
    megatron/checkpoint's iter_full_tensors yields them; only this stage's are kept), in
    evaluation mode. `prompt_layout`: a tuned prompt's (megatron/model/prompt.py), attached on
    stage 0, which embeds the encoder input (its `prompt.weight` among `tensors`). `sharded`:
    `tensors` are this rank's shards already (a trained stage's own; pipeline/builder.py's
    `load_tensors`).

    Raises:
        StateDictError: the tensors do not fit this stage's parts (names or shapes).
    """
    model = model_from_tensors(config, tensors, sharded=sharded,
                               make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                               backend=backend, tp=tp, ep=ep, device=device, dtype=dtype,
                               cut=cut, stage=stage, prompt_layout=prompt_layout)
    return PipelineStage(model, cut, stage, tuple(ranks), group, torch.device(device))


def pipeline_of_this_process() -> Tuple[int, Tuple[int, ...], object]:
    """(this process's stage, the global ranks of its pipeline group's stages, the group),
    from megatron.parallel_state (initialized)."""
    from megatron import parallel_state

    layout = parallel_state.get_layout()
    ranks = tuple(layout.global_rank(layout.tensor_rank, layout.data_rank, p)
                  for p in range(layout.pipeline_size))
    return layout.pipeline_rank, ranks, parallel_state.get_pipeline_model_parallel_group()
