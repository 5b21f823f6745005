"""The expert-parallel part of a checkpoint the trainer writes (megatron/training/experts.py), read
as each tensor rank's shards with all the experts joined (deepspeed.py builds on it).

With `--expert-model-parallel-size EP` > 1 (meta.json's layout then has
"expert_model_parallel_size"), expert rank r holds experts [r E / EP, (r + 1) E / EP) of every
stacked expert weight ([experts, ...]); data rank d has expert rank d % EP and expert-data rank
d // EP. Beside DeepSpeed's files, as for a dense model (T = DeepSpeed's model-parallel rank):

    mp_rank_TT_model_states.pt            'module' as written by data rank 0: the dense weights
                                          and buffers, and expert rank 0's experts only
    expert_parallel_rank_EE_mp_rank_TT_model_states.pt
                                          {name: expert rank EE's [E / EP, ...] weights}, ours
    zero_pp_rank_D_mp_rank_TT_optim_states.pt
                                          ZeRO-1/2: the expert weights are in their own
                                          parameter groups (DeepSpeed's `moe` groups, named
                                          ep_size_EP), partitioned over the expert-data-parallel
                                          group (the data ranks equal modulo EP) rather than
                                          over all data ranks
    expp_rank_E_mp_rank_TT_optim_states.pt
                                          ZeRO-0: {'optimizer': torch's AdamW state_dict} of
                                          expert rank E (DeepSpeed's MoE files, written by its
                                          first expert-data-parallel rank); the model file's
                                          'optimizer' is expert rank 0's

With a pipeline (M = stage * TP + T), DeepSpeed's MoE checkpoint writes no layer files: the
model file of each stage holds that stage's whole state dict, and the expert files hold the
stage's experts under the single-process names (deepspeed.py reads them).
ZeRO-3 never holds experts (the trainer refuses it for a Mixture-of-Experts model).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Dict, Iterable, List

import torch

from megatron.checkpoint.formats.deepspeed_files import CheckpointReadError, ExpertParts, Files, \
    Shard

EXPERT_FILE = "expert_parallel_rank_{ep:02d}_mp_rank_{mp:02d}_model_states.pt"
"""An expert-parallel rank's experts (the trainer writes it; training/experts.py)."""
EXPERT_OPTIMIZER_FILE = "expp_rank_{ep}_mp_rank_{mp:02d}_optim_states.pt"
"""DeepSpeed's per-expert-rank optimizer file of a run without ZeRO."""


def expert_size(layout: Dict[str, Any]) -> int:
    """The expert-parallel size of a layout (1 when it does not say)."""
    return int(layout.get("expert_model_parallel_size", 1) or 1)


def expert_files(layout: Dict[str, Any]) -> List[str]:
    """The files a layout adds for its experts (none with EP 1)."""
    ep = expert_size(layout)
    if ep == 1:
        return []
    ranks = layout["tensor_model_parallel_size"] * layout["pipeline_model_parallel_size"]
    names = [EXPERT_FILE.format(ep=e, mp=m) for m in range(ranks) for e in range(ep)]
    if layout["zero_stage"] == 0:
        names += [EXPERT_OPTIMIZER_FILE.format(ep=e, mp=m) for m in range(ranks)
                  for e in range(ep)]
    return names


def describe_experts(config, expert_parallel_size: int) -> Dict[str, Any]:
    """--inspect's summary of a Mixture-of-Experts model (a T5Config) and its expert split."""
    return {"num_experts": config.num_experts, "expert_model_parallel_size": expert_parallel_size,
            "router_type": config.router_type, "experts_per_token": config.router_k,
            "sparse_encoder_blocks": config.sparse_blocks(False),
            "sparse_decoder_blocks": config.sparse_blocks(True),
            "expert_bias": config.moe_expert_bias}


def check_readable(layout: Dict[str, Any], folder) -> None:
    """Raises CheckpointReadError for the expert-parallel layouts this reader does not read."""
    if expert_size(layout) > 1 and layout["zero_stage"] == 3:
        raise CheckpointReadError(f"{folder}: experts split over ranks under ZeRO-3: not a "
                                  f"layout the trainer writes")


def expert_weights(files: Files, layout: Dict[str, Any], model_rank: int,
                   local: Dict[str, Shard], experts: Iterable[str]) -> Dict[str, Shard]:
    """`local` (a model file's weights) with each expert weight read from every expert rank's
    expert file instead of the model file's expert rank 0 alone."""
    ep = expert_size(layout)
    if ep == 1:
        return local
    out = dict(local)
    states = [files.get(EXPERT_FILE.format(ep=e, mp=model_rank)) for e in range(ep)]
    for name in experts:
        parts = []
        for e, state in enumerate(states):
            if not isinstance(state, dict) or not torch.is_tensor(state.get(name)):
                where = files.folder / EXPERT_FILE.format(ep=e, mp=model_rank)
                raise CheckpointReadError(f"{where}: no tensor {name}")
            parts.append(partial(_clone, state, name))
        out[name] = ExpertParts(parts)
    return out


def _clone(state: Dict[str, torch.Tensor], name: str) -> torch.Tensor:
    return state[name].clone()


def zero0_expert_moments(files: Files, layout: Dict[str, Any], model_rank: int,
                         local: Dict[str, Shard], experts: Iterable[str],
                         read: Callable[[str], Dict[str, Shard]]) -> Dict[str, Shard]:
    """`local` (ZeRO-0 moments read from the model file: expert rank 0's experts) with each
    expert weight's moment joined over the expert ranks' optimizer files; read(file name) reads
    one file's moments by parameter name."""
    ep = expert_size(layout)
    if ep == 1:
        return local
    out = dict(local)
    ranks = [read(EXPERT_OPTIMIZER_FILE.format(ep=e, mp=model_rank)) for e in range(ep)]
    for name in experts:
        missing = [e for e, shards in enumerate(ranks) if name not in shards]
        if missing:
            raise CheckpointReadError(
                f"{files.folder / EXPERT_OPTIMIZER_FILE.format(ep=missing[0], mp=model_rank)}: "
                f"no optimizer state for {name}")
        out[name] = ExpertParts([shards[name] for shards in ranks])
    return out
