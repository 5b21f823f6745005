"""Read any checkpoint the trainer writes as full tensors under our names, without process groups.

What `--save DIR` holds (megatron/checkpoint/io/checkpointing.py; DeepSpeed 0.19's files inside):

    DIR/latest_checkpointed_iteration.txt      the newest complete iteration (the tracker)
    DIR/iter_NNNNNNN/meta.json                 iteration, layout, flags, and the model: its
                                               config, vocabulary padding, precision

Without a pipeline, T = tensor rank, D = data-parallel rank:

    mp_rank_TT_model_states.pt                 'module': rank T's weights (ZeRO 0-2; shards,
                                               padded vocabulary); 'param_shapes': the
                                               optimizer's parameters, in its order
    zero_pp_rank_D_mp_rank_TT_model_states.pt  ZeRO-3 instead: empty placeholders, param_shapes
    [bf16_]zero_pp_rank_D_mp_rank_TT_optim_states.pt
                                               ZeRO 1-3: rank D's part of the fp32 masters (the
                                               'bf16_' prefix whenever bf16 is on)

With a pipeline, M = stage * TP + T (DeepSpeed's model-parallel rank):

    layer_LL-model_TT-model_states.pt          layer LL's state dict ('block.layer.0...')
    tied_KEY-model_TT-model_states.pt          a tied module, once (the shared embedding,
                                               a stack's relative attention bias table)
    pipeline_layers.json                       each layer's single-process name, the stage
                                               starts, the tied modules' parameter names
    mp_rank_MM_model_states.pt, [bf16_]zero_pp_rank_D_mp_rank_MM_optim_states.pt   as above

    (with experts split over ranks, DeepSpeed's MoE checkpoint: no layer or tied files; each
    stage's whole state dict, by its layers' numbers, is the 'module' of its mp_rank_MM file)

The reader, one module per concept: the folder and tracker (deepspeed_folder.py; the names in
the folder: megatron/checkpoint/layout.py); meta.json and what a checkpoint is (meta.py); full
tensors from each tensor rank's shards (deepspeed_tensors.py); a pipeline's layer and tied files
(deepspeed_pipeline.py); the optimizer's masters, moments and step (deepspeed_optimizer.py);
--inspect (deepspeed_describe.py). This module is their public face.
The fp32 masters' ZeRO layouts, the safe loader and its allow-list: deepspeed_files.py. With
experts split over ranks (`--expert-model-parallel-size`), the expert files beside these:
deepspeed_experts.py; every expert weight is read whole ([experts, ...]) whatever the split.

Files are opened with `torch.load(mmap=True, weights_only=True)`: nothing is read until a tensor
is asked for, so memory holds the tensor being assembled and its shards, whatever the checkpoint
size. The only non-tensor objects allowed in the pickles are `ALLOWED_GLOBALS`; nothing is
ever loaded with weights_only=False.
"""

from megatron.checkpoint.formats.deepspeed_describe import describe
from megatron.checkpoint.formats.deepspeed_files import (
    ALLOWED_GLOBALS,
    CheckpointReadError,
    load_file,
)
from megatron.checkpoint.formats.deepspeed_folder import LAYERS_FILE, find_iteration
from megatron.checkpoint.formats.meta import META, model_config, read_meta
from megatron.checkpoint.formats.deepspeed_optimizer import optimizer_step
from megatron.checkpoint.formats.deepspeed_tensors import (
    MOMENTS,
    SOURCES,
    check_optimizer_states,
    iter_full_tensors,
    model_source,
)
from megatron.checkpoint.layout import TRACKER  # re-exported: the folder's names are layout.py's

__all__ = ["ALLOWED_GLOBALS", "CheckpointReadError", "LAYERS_FILE", "META", "MOMENTS", "SOURCES",
           "TRACKER", "check_optimizer_states", "describe", "find_iteration", "iter_full_tensors",
           "load_file", "model_config", "model_source", "optimizer_step", "read_meta"]
