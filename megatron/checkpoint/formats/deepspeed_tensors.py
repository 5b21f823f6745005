"""Full tensors under our names from a checkpoint's files: each tensor rank's shards found in
whichever files hold them (model, pipeline, expert or optimizer files), checked against the
model meta.json describes, joined and unpadded.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import torch

from megatron.checkpoint.formats.deepspeed_experts import check_readable, expert_weights
from megatron.checkpoint.formats.deepspeed_files import (
    CheckpointReadError,
    Files,
    Shard,
    model_file,
    zero_masters,
)
from megatron.checkpoint.formats.deepspeed_folder import PathLike
from megatron.checkpoint.formats.meta import (
    META,
    is_weights_format,
    kind_of,
    model_config,
    precision_of,
    read_meta,
)
from megatron.checkpoint.formats.deepspeed_optimizer import optimizer_shards, optimizer_step
from megatron.checkpoint.formats.deepspeed_pipeline import owned, pipeline_weights
from megatron.checkpoint.formats.weights import WeightsError, WeightsReader, full_tensors
from megatron.model.config import T5Config
from megatron.model.prompt import PROMPT_PARAMETER
from megatron.model.meta import buffer_shapes, expert_parameters, parameter_splits
from megatron.model.state_dict import VOCAB_PARAMETERS
from megatron.tensor_parallel.layers import unshard

SOURCES = ("master", "weights", "exp_avg", "exp_avg_sq")
MOMENTS = ("exp_avg", "exp_avg_sq")


def model_source(meta: Dict[str, Any]) -> str:
    """The `source` of `iter_full_tensors` that holds a checkpoint's model (meta.json's
    contents): the fp32 masters, except where DeepSpeed's fp16 optimizer without ZeRO keeps
    them unnamed ("weights")."""
    if (meta.get("layout") or {}).get("zero_stage") == 0 and \
            (meta.get("model") or {}).get("precision") == "fp16":
        return "weights"
    return "master"


def iter_full_tensors(iter_dir: PathLike, source: str = "master"
                      ) -> Iterator[Tuple[str, torch.Tensor]]:
    """(name, full tensor) for every parameter, one at a time, in the model's order: Hugging Face
    T5 names, tensor-parallel shards joined, vocabulary rows unpadded, each a new tensor; every
    expert weight whole ([experts, ...], the expert-parallel ranks' parts joined). Then the
    persistent buffers (the expert biases of `moe_expert_bias`), except for the moments; and a
    second prompt-tuning stage's prompt (`prompt.weight`, --prompt-train-model), saved with the
    model.

    source: 'master' reads the fp32 master copy where the checkpoint has one (ZeRO 1-3, the
        optimizer files), else the weights (fp32 ZeRO-0, where they are the masters);
        'weights' reads the module weights in the training precision (under ZeRO-3, which
        saves no weights, the masters cast to it: what DeepSpeed copies into the parameters).
        'exp_avg' and 'exp_avg_sq' read Adam's moments (fp32; see `optimizer_step`).
        A weights-only checkpoint (megatron/checkpoint/formats/weights.py) has one copy of the
        weights (either source gives it) and the moments where it was converted with them.

    Raises:
        CheckpointReadError: a missing, truncated or foreign file, or tensors that do not fit
            the model meta.json describes; checked for every tensor rank before the first yield
            where the names alone tell.
    """
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, not {source!r}")
    folder = Path(iter_dir)
    meta = read_meta(folder)
    if is_weights_format(meta):
        yield from _weights_format_tensors(folder, source if source in MOMENTS else "model")
        return
    kind = kind_of(meta, folder / META)
    if kind.prompt_alone:  # the frozen model is the base's: its files hold no model
        base = (kind.prompt_base or {}).get("load", "BASE")
        raise CheckpointReadError(
            f"{folder} holds a tuned prompt alone (a --prompt-tune run's checkpoint, the model "
            f"frozen), not a model: convert its base model instead (--load {base}); a Hugging "
            f"Face T5 has no place for the prompt: decode with it with python -m "
            f"megatron.generate --load {base} --prompt-load {folder.parent}")
    config = model_config(meta, folder / META)
    check_readable(meta["layout"], folder)
    tensor_size = meta["layout"]["tensor_model_parallel_size"]
    params = parameter_splits(config)
    if kind.prompt is not None and not kind.prompt_alone:  # a prompt trained with the model
        params[PROMPT_PARAMETER] = ((kind.prompt_layout.length, config.d_model), None)
    if source not in MOMENTS:  # persistent buffers (expert biases) have no optimizer state
        params.update((n, (shape, None)) for n, shape in buffer_shapes(config).items())
    files = Files(folder)
    shards = [tensor_rank_shards(files, meta, source, t, config) for t in range(tensor_size)]
    for t, found in enumerate(shards):
        check_names(found, params, folder, t)
    for name, (shape, split) in params.items():
        yield name, full_tensor(name, shape, split, shards, meta, config, folder)


def full_tensor(name: str, shape, split, shards: List[Dict[str, Shard]], meta: Dict[str, Any],
           config: T5Config, folder: Path) -> torch.Tensor:
    """Tensor `name` whole (a new tensor) from every tensor rank's `shards`: joined along
    `split` (parameter_splits'), vocabulary rows unpadded, its shape checked against `shape`
    (also what megatron/checkpoint/io/reshard.py reads a tensor with)."""
    divisible = int(meta["model"].get("make_vocab_size_divisible_by", 128))
    tensor_size = len(shards)
    parts = [rank[name]() for rank in shards]
    tensor = unshard(parts, *split) if split is not None and tensor_size > 1 else parts[0]
    if name in VOCAB_PARAMETERS:
        padded = config.padded_vocab_size(divisible, tensor_size)
        if tensor.shape[0] != padded:
            raise CheckpointReadError(
                f"{folder}: tensor {name} has {tensor.shape[0]} rows; meta.json's vocab_size "
                f"{config.vocab_size} padded to a multiple of {divisible} x TP "
                f"{tensor_size} is {padded}")
        tensor = tensor[:config.vocab_size].clone()
    if tuple(tensor.shape) != shape:
        raise CheckpointReadError(f"{folder}: tensor {name} has shape {tuple(tensor.shape)}; "
                                  f"the model meta.json describes has {shape}")
    return tensor


def check_names(found: Dict[str, Shard], params, folder: Path, tensor_rank: int) -> None:
    """Raise CheckpointReadError unless a tensor rank's files hold exactly the model's names."""
    missing = [n for n in params if n not in found]
    unexpected = sorted(set(found) - set(params))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}")
        if unexpected:
            parts.append(f"unexpected {', '.join(unexpected[:6])}"
                         f"{' ...' if len(unexpected) > 6 else ''}")
        raise CheckpointReadError(f"{folder}: the files of tensor rank {tensor_rank} do not hold "
                                  f"the model meta.json describes: {'; '.join(parts)}")


def _weights_format_tensors(folder: Path, prefix: str) -> Iterator[Tuple[str, torch.Tensor]]:
    try:
        yield from full_tensors(WeightsReader(folder, prefix))
    except WeightsError as e:
        raise CheckpointReadError(str(e)) from None


def tensor_rank_shards(files: Files, meta: Dict[str, Any], source: str,
                        tensor_rank: int, config: T5Config) -> Dict[str, Shard]:
    """{our name: its shard on `tensor_rank`} from whichever files hold it."""
    layout, precision = meta["layout"], precision_of(meta)
    zero = layout["zero_stage"]
    experts = expert_parameters(config)
    if source in MOMENTS:
        return optimizer_shards(files, layout, precision, source, tensor_rank, experts)
    if source == "master" and zero == 0 and precision == "fp16":
        raise CheckpointReadError(
            f"{files.folder}: fp16 with ZeRO-0 keeps its fp32 masters inside DeepSpeed's fp16 "
            f"optimizer state, without parameter names; read source='weights' (fp16) instead")
    if source == "master" and zero > 0:
        out = optimizer_shards(files, layout, precision, "fp32", tensor_rank, experts)
        buffers = buffer_shapes(config)
        if buffers:  # not the optimizer's: from the weights' files
            weights = _weights(files, layout, precision, tensor_rank, experts)
            out.update((n, shard) for n, shard in weights.items() if n in buffers)
        return out
    return _weights(files, layout, precision, tensor_rank, experts)


def _weights(files: Files, layout: Dict[str, Any], precision: str, tensor_rank: int,
             experts) -> Dict[str, Shard]:
    """{our name: its shard on `tensor_rank`} of the module weights (and buffers)."""
    if layout["pipeline_model_parallel_size"] > 1:
        return pipeline_weights(files, layout, tensor_rank, experts)
    if layout["zero_stage"] == 3:  # no weights saved: the masters cast to the training precision
        out = zero_masters(files, layout, tensor_rank, precision == "bf16")
        placeholders = files.field(model_file(tensor_rank, layout), "module")
        dtype = next(iter(placeholders.values())).dtype
        return {n: (lambda s=s: s().to(dtype)) for n, s in out.items()}
    name = model_file(tensor_rank, layout)
    module = files.field(name, "module")
    local = {n: partial(owned, module, n) for n in module}
    return expert_weights(files, layout, tensor_rank, local, experts)



def check_optimizer_states(iter_dir: PathLike) -> int:
    """Adam's step count, once the files of every tensor rank are found to hold both moments
    for every parameter (what `iter_full_tensors` checks before its first tensor).

    Raises:
        CheckpointReadError: why the checkpoint's optimizer states cannot be read."""
    folder = Path(iter_dir)
    meta = read_meta(folder)
    step = optimizer_step(folder)
    if is_weights_format(meta):
        return step
    config = model_config(meta, folder / META)
    check_readable(meta["layout"], folder)
    params = parameter_splits(config)
    files = Files(folder)
    for key in MOMENTS:
        for t in range(meta["layout"]["tensor_model_parallel_size"]):
            check_names(tensor_rank_shards(files, meta, key, t, config), params, folder, t)
    return step
