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

The fp32 masters' ZeRO layouts, the safe loader and its allow-list: deepspeed_files.py. With
experts split over ranks (`--expert-model-parallel-size`), the expert files beside these:
deepspeed_experts.py; every expert weight is read whole ([experts, ...]) whatever the split.

Files are opened with `torch.load(mmap=True, weights_only=True)`: nothing is read until a tensor
is asked for, so memory holds the tensor being assembled and its shards, whatever the checkpoint
size. The only non-tensor objects allowed in the pickles are `ALLOWED_GLOBALS`; nothing is
ever loaded with weights_only=False.
"""

from __future__ import annotations

import json
import math
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import torch

from megatron.checkpoint.formats.deepspeed_experts import (
    check_readable,
    describe_experts,
    expert_files,
    expert_size,
    expert_weights,
    zero0_expert_moments,
)
from megatron.checkpoint.formats.deepspeed_files import (
    ALLOWED_GLOBALS,
    OPTIMIZER_PARAMETERS,
    CheckpointReadError,
    Files,
    Shard,
    load_file,
    model_file,
    zero_masters,
)
from megatron.checkpoint.formats.weights import WeightsError, WeightsReader, full_tensors
from megatron.model.config import ConfigError, T5Config
from megatron.model.meta import buffer_shapes, expert_parameters, parameter_splits
from megatron.model.state_dict import VOCAB_PARAMETERS
from megatron.pipeline.module import single_process_names, tied_names
from megatron.tensor_parallel.layers import unshard

__all__ = ["ALLOWED_GLOBALS", "CheckpointReadError", "SOURCES", "check_optimizer_states",
           "describe", "find_iteration", "iter_full_tensors", "load_file", "model_config",
           "optimizer_step", "read_meta"]

TRACKER = "latest_checkpointed_iteration.txt"
META = "meta.json"
LAYERS_FILE = "pipeline_layers.json"
SOURCES = ("master", "weights", "exp_avg", "exp_avg_sq")
MOMENTS = ("exp_avg", "exp_avg_sq")

PathLike = Union[str, Path]


# The folder and meta.json ---------------------------------------------------------------------
def find_iteration(ckpt_dir: PathLike, iteration: Optional[int] = None) -> Path:
    """The iteration folder to read: `iteration`'s, else the tracker's. An iteration folder
    itself (one holding meta.json) is returned as it is.

    Raises:
        CheckpointReadError: no such folder, a missing or garbled tracker, a missing iteration.
    """
    root = Path(ckpt_dir)
    if not root.is_dir():
        raise CheckpointReadError(f"{root}: no such checkpoint folder")
    if iteration is None and (root / META).is_file():
        return root
    tracker = root / TRACKER
    from_tracker = iteration is None
    if from_tracker:
        if not tracker.is_file():
            found = _iteration_folders(root)
            hint = (f"; it has {', '.join(found[-3:])}: pass the iteration to read one"
                    if found else "")
            raise CheckpointReadError(f"{tracker}: missing, so {root} holds no complete "
                                      f"checkpoint of our trainer{hint}{_foreign(root)}")
        text = tracker.read_text(encoding="utf-8", errors="replace").strip()
        if text == "release":
            raise CheckpointReadError(f"{tracker} says 'release': a Megatron-LM release "
                                      f"checkpoint, not one written by this trainer")
        try:
            iteration = int(text)
        except ValueError:
            raise CheckpointReadError(f"{tracker} holds {text[:40]!r}, not an iteration "
                                      f"number; pass the iteration to read") from None
    folder = root / f"iter_{int(iteration):07d}"
    if not folder.is_dir():
        found = _iteration_folders(root)
        said = f" ({tracker.name} names it)" if from_tracker else ""
        raise CheckpointReadError(f"{folder}: missing{said}; iterations in {root}: "
                                  f"{', '.join(found) or 'none'}")
    return folder


def _iteration_folders(root: Path) -> List[str]:
    return sorted(p.name for p in root.glob("iter_*") if p.is_dir())


def _foreign(folder: Path) -> str:
    """What another tool's folder looks like, as a hint ('' when nothing is recognised)."""
    if (folder / "config.json").is_file() and any(
            (folder / n).is_file() for n in ("model.safetensors", "model.safetensors.index.json",
                                             "pytorch_model.bin")):
        return "; it looks like a Hugging Face model folder (convert it with --from hf)"
    if (folder / "latest").is_file():
        return ("; it has DeepSpeed's 'latest' file only: saved by DeepSpeed directly, not by "
                "this trainer")
    if any(folder.glob("*/model_optim_rng.pt")) or any(folder.glob("*/*/model_optim_rng.pt")):
        return "; it looks like a Megatron-LM checkpoint (model_optim_rng.pt), not this trainer's"
    return ""


def read_meta(iter_dir: PathLike) -> Dict[str, Any]:
    """The iteration folder's meta.json.

    Raises:
        CheckpointReadError: missing, not JSON, or not written by our trainer (no layout).
    """
    folder = Path(iter_dir)
    path = folder / META
    if not path.is_file():
        raise CheckpointReadError(f"{path}: missing, so {folder} is not an iteration folder "
                                  f"written by our trainer{_foreign(folder)}")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointReadError(f"{path}: unreadable ({e}); the checkpoint is damaged") \
            from None
    if _is_weights_format(meta):
        return meta
    layout = meta.get("layout") if isinstance(meta, dict) else None
    keys = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size",
            "zero_stage")
    if not isinstance(layout, dict) or not all(isinstance(layout.get(k), int) for k in keys):
        raise CheckpointReadError(f"{path}: no 'layout' with {', '.join(keys)}: not the "
                                  f"meta.json of a checkpoint written by our trainer")
    return meta


def model_config(meta: Dict[str, Any], where: PathLike = META) -> T5Config:
    """The architecture meta.json records ('model.config'); `where` names the file in errors.

    Raises:
        CheckpointReadError: no 'model' section (a checkpoint written before meta.json recorded
            the model), or a config that is not a T5 architecture.
    """
    model = meta.get("model")
    if not isinstance(model, dict) or "config" not in model:
        flags = meta.get("flags") or {}
        raise CheckpointReadError(
            f"{where}: no 'model' section: this checkpoint was written before meta.json "
            f"recorded the model, so its architecture is unknown here. Its run used "
            f"--model-config {flags.get('model_config')} and --make-vocab-size-divisible-by "
            f"{flags.get('make_vocab_size_divisible_by')}; add to meta.json "
            f"\"model\": {{\"config\": <that file's JSON>, \"make_vocab_size_divisible_by\": "
            f"<that number>, \"precision\": \"{flags.get('precision', 'fp32')}\"}}")
    kind = model["config"].get("model_type", "t5") if isinstance(model["config"], dict) else None
    if kind not in ("t5", "mt5"):
        raise CheckpointReadError(f"{where} (model.config): model_type {kind!r} is not a T5 "
                                  f"model; this reader reads T5 encoder-decoders only")
    try:
        return T5Config.from_dict(model["config"], source=f"{where} (model.config)")
    except ConfigError as e:
        raise CheckpointReadError(f"{e}; this reader reads T5 encoder-decoders only") from None


def _is_weights_format(meta) -> bool:
    return isinstance(meta, dict) and meta.get("format") == "weights"


def _precision(meta: Dict[str, Any]) -> str:
    return (meta.get("model") or {}).get("precision") \
        or (meta.get("flags") or {}).get("precision") or "fp32"


# Full tensors ---------------------------------------------------------------------------------
def iter_full_tensors(iter_dir: PathLike, source: str = "master"
                      ) -> Iterator[Tuple[str, torch.Tensor]]:
    """(name, full tensor) for every parameter, one at a time, in the model's order: Hugging Face
    T5 names, tensor-parallel shards joined, vocabulary rows unpadded, each a new tensor; every
    expert weight whole ([experts, ...], the expert-parallel ranks' parts joined). Then the
    persistent buffers (the expert biases of `moe_expert_bias`), except for the moments.

    source: 'master' reads the fp32 master copy where the checkpoint has one (ZeRO 1-3, the
        optimizer files), else the weights (fp32 ZeRO-0, where they are the masters);
        'weights' reads the module weights in the training precision (under ZeRO-3, which
        saves no weights, the masters cast to it: what DeepSpeed copies into the parameters).
        'exp_avg' and 'exp_avg_sq' read Adam's moments (fp32; see `optimizer_step`).
        A weights-only checkpoint (megatron/checkpoint/formats/weights.py) has one copy of the weights
        (either source gives it) and the moments where it was converted with them.

    Raises:
        CheckpointReadError: a missing, truncated or foreign file, or tensors that do not fit
            the model meta.json describes; checked for every tensor rank before the first yield
            where the names alone tell.
    """
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, not {source!r}")
    folder = Path(iter_dir)
    meta = read_meta(folder)
    if _is_weights_format(meta):
        yield from _weights_format_tensors(folder, source if source in MOMENTS else "model")
        return
    config = model_config(meta, folder / META)
    check_readable(meta["layout"], folder)
    divisible = int(meta["model"].get("make_vocab_size_divisible_by", 128))
    tensor_size = meta["layout"]["tensor_model_parallel_size"]
    params = parameter_splits(config)
    if source not in MOMENTS:  # persistent buffers (expert biases) have no optimizer state
        params.update((n, (shape, None)) for n, shape in buffer_shapes(config).items())
    files = Files(folder)
    shards = [_tensor_rank_shards(files, meta, source, t, config) for t in range(tensor_size)]
    for t, found in enumerate(shards):
        _check_names(found, params, folder, t)
    padded = config.padded_vocab_size(divisible, tensor_size)
    for name, (shape, split) in params.items():
        parts = [rank[name]() for rank in shards]
        tensor = unshard(parts, *split) if split is not None and tensor_size > 1 else parts[0]
        if name in VOCAB_PARAMETERS:
            if tensor.shape[0] != padded:
                raise CheckpointReadError(
                    f"{folder}: tensor {name} has {tensor.shape[0]} rows; meta.json's vocab_size "
                    f"{config.vocab_size} padded to a multiple of {divisible} x TP "
                    f"{tensor_size} is {padded}")
            tensor = tensor[:config.vocab_size].clone()
        if tuple(tensor.shape) != shape:
            raise CheckpointReadError(f"{folder}: tensor {name} has shape {tuple(tensor.shape)}; "
                                      f"the model meta.json describes has {shape}")
        yield name, tensor


def _check_names(found: Dict[str, Shard], params, folder: Path, tensor_rank: int) -> None:
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


def _tensor_rank_shards(files: Files, meta: Dict[str, Any], source: str,
                        tensor_rank: int, config: T5Config) -> Dict[str, Shard]:
    """{our name: its shard on `tensor_rank`} from whichever files hold it."""
    layout, precision = meta["layout"], _precision(meta)
    zero = layout["zero_stage"]
    experts = expert_parameters(config)
    if source in MOMENTS:
        return _optimizer_shards(files, layout, precision, source, tensor_rank, experts)
    if source == "master" and zero == 0 and precision == "fp16":
        raise CheckpointReadError(
            f"{files.folder}: fp16 with ZeRO-0 keeps its fp32 masters inside DeepSpeed's fp16 "
            f"optimizer state, without parameter names; read source='weights' (fp16) instead")
    if source == "master" and zero > 0:
        out = _optimizer_shards(files, layout, precision, "fp32", tensor_rank, experts)
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
        return _pipeline_weights(files, layout, tensor_rank, experts)
    if layout["zero_stage"] == 3:  # no weights saved: the masters cast to the training precision
        out = zero_masters(files, layout, tensor_rank, precision == "bf16")
        placeholders = files.field(model_file(tensor_rank, layout), "module")
        dtype = next(iter(placeholders.values())).dtype
        return {n: (lambda s=s: s().to(dtype)) for n, s in out.items()}
    name = model_file(tensor_rank, layout)
    module = files.field(name, "module")
    local = {n: partial(_owned, module, n) for n in module}
    return expert_weights(files, layout, tensor_rank, local, experts)


def _owned(state: Dict[str, torch.Tensor], name: str) -> torch.Tensor:
    return state[name].clone()


def _optimizer_shards(files: Files, layout: Dict[str, int], precision: str, key: str,
                      tensor_rank: int, experts=()) -> Dict[str, Shard]:
    """{our name: the optimizer's `key` ('fp32': the masters, or one of MOMENTS) on
    `tensor_rank`}, from every pipeline stage (a tied parameter from its first): the ZeRO files'
    flat partitions, or under ZeRO-0 (moments only: its masters are the weights) torch's
    optimizer state_dict in the model-states file, named by the trainer's OPTIMIZER_PARAMETERS
    record (and, for the `experts` with EP > 1, in each expert rank's DeepSpeed file)."""
    zero, bf16 = layout["zero_stage"], precision == "bf16"
    if zero == 0 and precision == "fp16":
        raise CheckpointReadError(f"{files.folder}: fp16 with ZeRO-0 keeps its optimizer inside "
                                  f"DeepSpeed's fp16 optimizer state, without parameter names")
    stages = layout["pipeline_model_parallel_size"]
    tensor_size = layout["tensor_model_parallel_size"]
    layers, tied = _pipeline_layers(files.folder) if stages > 1 else ([], {})
    out: Dict[str, Shard] = {}
    for stage in range(stages):
        rank = stage * tensor_size + tensor_rank
        def ours(shards: Dict[str, Shard]) -> Dict[str, Shard]:
            if stages == 1:
                return shards
            return _single_process(shards, layers, tied, files.folder)

        if zero > 0:
            local = ours(zero_masters(files, layout, rank, bf16, key))
        else:
            order = model_file(rank, layout)
            local = ours(_zero0_moments(files, order, key))
            local = zero0_expert_moments(
                files, layout, rank, local, [e for e in experts if e in local],
                lambda name, order=order: ours(_zero0_moments(files, order, key, name)))
        for name, shard in local.items():
            out.setdefault(name, shard)
    return out


def _zero0_moments(files: Files, name: str, key: str,
                   state_file: Optional[str] = None) -> Dict[str, Shard]:
    """The moment `key` by parameter name from torch's optimizer state_dict in model file `name`
    (or in `state_file`, an expert rank's, with the same parameters in the same order)."""
    state = files.field(state_file or name, "optimizer")
    order = files.get(name).get(OPTIMIZER_PARAMETERS)
    where = files.folder / (state_file or name)
    if not order:
        raise CheckpointReadError(f"{where}: no {OPTIMIZER_PARAMETERS!r} record, so the "
                                  f"parameters of its optimizer state are unknown (saved by an "
                                  f"earlier version of the trainer)")
    groups, per = state.get("param_groups") or [], state.get("state") or {}
    if len(groups) != len(order) or any(len(g["params"]) != len(names)
                                        for g, names in zip(groups, order)):
        raise CheckpointReadError(f"{where}: the optimizer's groups hold "
                                  f"{[len(g['params']) for g in groups]} parameters; its "
                                  f"{OPTIMIZER_PARAMETERS!r} names {[len(n) for n in order]}")
    out = {}
    for group, names in zip(groups, order):
        for index, param in zip(group["params"], names):
            entry = per.get(index)
            if not isinstance(entry, dict) or not torch.is_tensor(entry.get(key)):
                raise CheckpointReadError(f"{where}: no optimizer state {key!r} for {param} (an "
                                          f"optimizer other than Adam, or saved before its "
                                          f"first step)")
            out[param] = partial(_owned, entry, key)
    return out


def check_optimizer_states(iter_dir: PathLike) -> int:
    """Adam's step count, once the files of every tensor rank are found to hold both moments
    for every parameter (what `iter_full_tensors` checks before its first tensor).

    Raises:
        CheckpointReadError: why the checkpoint's optimizer states cannot be read."""
    folder = Path(iter_dir)
    meta = read_meta(folder)
    step = optimizer_step(folder)
    if _is_weights_format(meta):
        return step
    config = model_config(meta, folder / META)
    check_readable(meta["layout"], folder)
    params = parameter_splits(config)
    files = Files(folder)
    for key in MOMENTS:
        for t in range(meta["layout"]["tensor_model_parallel_size"]):
            _check_names(_tensor_rank_shards(files, meta, key, t, config), params, folder, t)
    return step


def optimizer_step(iter_dir: PathLike) -> int:
    """Adam's step count in a checkpoint (the same in every group and on every rank).

    Raises:
        CheckpointReadError: a checkpoint without optimizer states."""
    folder = Path(iter_dir)
    meta = read_meta(folder)
    if _is_weights_format(meta):
        step = (meta.get("optimizer") or {}).get("step")
        if not isinstance(step, int):
            raise CheckpointReadError(f"{folder / META}: a weights checkpoint without optimizer "
                                      f"states")
        return step
    layout, files = meta["layout"], Files(folder)
    if layout["zero_stage"] > 0:
        name = files.zero_name(0, 0, _precision(meta) == "bf16")
        state = files.field(name, "optimizer_state_dict")
        base = state.get("optimizer_state_dict" if layout["zero_stage"] == 3
                         else "base_optimizer_state") or {}
    else:
        name = model_file(0, layout)
        base = files.field(name, "optimizer")
    try:
        step = next(iter(base["state"].values()))["step"]
        return int(step.item() if torch.is_tensor(step) else step)
    except (KeyError, TypeError, StopIteration, AttributeError, ValueError):
        raise CheckpointReadError(f"{files.folder / name}: no Adam step count in its optimizer "
                                  f"state") from None


def _pipeline_weights(files: Files, layout: Dict[str, Any], tensor_rank: int,
                      experts) -> Dict[str, Shard]:
    """A tensor rank's module weights from the pipeline's layer and tied-module files; with
    experts split over ranks, from each stage's model file and expert files instead."""
    layers, tied = _pipeline_layers(files.folder)
    if expert_size(layout) > 1:
        return _pipeline_expert_weights(files, layout, tensor_rank, experts, layers, tied)
    local: Dict[str, Shard] = {}
    suffix = f"-model_{tensor_rank:02d}-model_states.pt"
    for path in sorted(files.folder.glob(f"layer_*{suffix}")):
        state = files.get(path.name)
        index = int(path.name[len("layer_"):-len(suffix)])
        local.update({f"{index}.{k}": partial(_owned, state, k) for k in state})
    for path in sorted(files.folder.glob(f"tied_*{suffix}")):
        state = files.get(path.name)
        key = path.name[len("tied_"):-len(suffix)]
        local.update({f"tied_modules.{key}.{k}": partial(_owned, state, k) for k in state})
    return _single_process(local, layers, tied, files.folder)


def _pipeline_expert_weights(files: Files, layout: Dict[str, Any], tensor_rank: int, experts,
                             layers: List[str], tied: Dict[str, str]) -> Dict[str, Shard]:
    """DeepSpeed's MoE checkpoint of a pipeline: stage s's whole state dict (its layers'
    numbered names) in model file M = s * TP + T, its experts in our expert files (the
    single-process names); a tied parameter from its first stage."""
    out: Dict[str, Shard] = {}
    experts = set(experts)
    for stage in range(layout["pipeline_model_parallel_size"]):
        rank = stage * layout["tensor_model_parallel_size"] + tensor_rank
        module = files.field(model_file(rank, layout), "module")
        local = _single_process({n: partial(_owned, module, n) for n in module}, layers, tied,
                                files.folder)
        local = expert_weights(files, layout, rank, local, sorted(experts & set(local)))
        for name, shard in local.items():
            out.setdefault(name, shard)
    return out


def _pipeline_layers(folder: Path) -> Tuple[List[str], Dict[str, str]]:
    path = folder / LAYERS_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return list(data["layers"]), dict(data["tied"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointReadError(f"{path}: missing or unreadable ({e}); a pipeline checkpoint "
                                  f"cannot be read without it") from None


def _single_process(local: Dict[str, Shard], layers: List[str], tied: Dict[str, str],
                    folder: Path) -> Dict[str, Shard]:
    """Stage parameter names ('3.block.layer.0...', 'tied_modules.shared.embedding.weight') to
    ours, by the pipeline module's own mapping."""
    if tied != tied_names():
        raise CheckpointReadError(f"{folder / LAYERS_FILE}: tied modules {tied} differ from this "
                                  f"version's {tied_names()}")
    stage = SimpleNamespace(layer_names=layers,
                            named_parameters=lambda: [(n, None) for n in local])
    try:
        names = single_process_names(stage)
    except (IndexError, ValueError, KeyError) as e:
        raise CheckpointReadError(f"{folder}: parameter names that {LAYERS_FILE} does not "
                                  f"explain ({e!r})") from None
    return {names[n]: shard for n, shard in local.items()}


# --inspect ------------------------------------------------------------------------------------
def describe(iter_dir: PathLike) -> Dict[str, Any]:
    """What an iteration folder holds, for `convert_checkpoint.py --inspect`: iteration,
    consumed samples, layout, precision and dtypes, the model and its parameter count (full,
    unpadded), where the masters are, whether optimizer states are present (and whether the
    conversion tool can carry them to another layout: Adam's step), the files and
    their sizes, and `problems` (missing or unreadable files, an unknown model) rather than an
    exception where a file is damaged. A Mixture-of-Experts model adds `experts`: the number,
    the expert-parallel size (a weights checkpoint's: the target it was converted for), routing
    and the sparse blocks.

    Raises:
        CheckpointReadError: no readable meta.json.
    """
    folder = Path(iter_dir)
    meta = read_meta(folder)
    listing = [{"name": str(p.relative_to(folder)), "bytes": p.stat().st_size}
               for p in sorted(folder.rglob("*")) if p.is_file()]
    out: Dict[str, Any] = {
        "path": str(folder), "iteration": meta.get("iteration"),
        "consumed_samples": meta.get("consumed_samples"), "saved_at": meta.get("saved_at"),
        "layout": meta.get("layout"), "files": listing,
        "total_bytes": sum(f["bytes"] for f in listing), "problems": []}
    if _is_weights_format(meta):
        optimizer = meta.get("optimizer")
        out.update(format="weights", model=meta.get("model"), parameters=meta.get("parameters"),
                   optimizer_states=optimizer is not None,
                   optimizer_step=(optimizer or {}).get("step"),
                   masters="the weights (fp32, full)" if optimizer else "none (weights only)")
        try:
            config = T5Config.from_dict((meta.get("model") or {}).get("config"))
            if config.is_moe:
                out["experts"] = describe_experts(config, expert_size(meta.get("layout") or {}))
        except ConfigError as e:
            out["problems"].append(f"{folder / META}: {e}")
        return out
    layout, precision = meta["layout"], _precision(meta)
    out.update(format="deepspeed", precision=precision, model=None, parameters=None)
    try:
        config = model_config(meta, folder / META)
        params = parameter_splits(config)
        out["model"] = meta["model"]
        out["parameters"] = sum(math.prod(shape) for shape, _ in params.values())
        if config.is_moe:
            out["experts"] = describe_experts(config, expert_size(layout))
    except CheckpointReadError as e:
        out["problems"].append(str(e))
    present = {f["name"] for f in listing}
    missing = [n for n in _expected_files(folder, layout, precision) if n not in present]
    if missing:
        out["problems"].append(f"missing files: {', '.join(missing)}")
    zero, files = layout["zero_stage"], Files(folder)
    try:
        first = files.get(model_file(0, layout))
        out["deepspeed_version"] = first.get("ds_version")
        out["dtypes"] = {"weights": _weights_dtype(files, layout, first),
                         "master": "float32" if zero > 0 or precision == "fp32" else None}
        out["optimizer_states"] = zero > 0 or first.get("optimizer") is not None
    except CheckpointReadError as e:
        out["problems"].append(str(e))
    out["optimizer_step"] = out["optimizer_states_convertible"] = None
    if out.get("optimizer_states"):
        try:
            out["optimizer_step"] = check_optimizer_states(folder)
            out["optimizer_states_convertible"] = True
        except CheckpointReadError as e:  # not damage: the tool then writes weights only
            out["optimizer_states_convertible"] = f"no: {e}"
    out["masters"] = (
        f"ZeRO-{zero} optimizer files (fp32, partitioned over "
        f"{layout['data_parallel_size']} data-parallel ranks)" if zero > 0 else
        "the weights themselves (fp32 with ZeRO-0)" if precision == "fp32" else
        "inside DeepSpeed's fp16 optimizer state (not read: use source='weights')")
    if layout["pipeline_model_parallel_size"] > 1 and (folder / LAYERS_FILE).is_file():
        try:
            out["pipeline_layers"] = json.loads((folder / LAYERS_FILE).read_text())
        except ValueError as e:
            out["problems"].append(f"{folder / LAYERS_FILE}: unreadable ({e})")
    return out


def _expected_files(folder: Path, layout: Dict[str, int], precision: str) -> List[str]:
    """DeepSpeed's model and optimizer files (and the pipeline's tied files) for the layout."""
    tp, pp, dp = (layout["tensor_model_parallel_size"], layout["pipeline_model_parallel_size"],
                  layout["data_parallel_size"])
    zero, files = layout["zero_stage"], Files(folder)
    names = []
    for m in range(tp * pp):
        names += ([f"zero_pp_rank_{d}_mp_rank_{m:02d}_model_states.pt" for d in range(dp)]
                  if zero == 3 else [f"mp_rank_{m:02d}_model_states.pt"])
        if zero > 0:
            names += [files.zero_name(d, m, precision == "bf16") for d in range(dp)]
    if pp > 1:
        names.append(LAYERS_FILE)
    if pp > 1 and expert_size(layout) == 1:  # with experts over ranks DeepSpeed's MoE layout:
        try:  # no tied files
            keys = list(json.loads((folder / LAYERS_FILE).read_text())["tied"])
        except (OSError, ValueError, KeyError):
            keys = []
        names += [f"tied_{k}-model_{t:02d}-model_states.pt" for k in keys for t in range(tp)]
    return names + expert_files(layout)


def _weights_dtype(files: Files, layout: Dict[str, int], first: Dict[str, Any]) -> str:
    if layout["pipeline_model_parallel_size"] > 1:
        layer = next(iter(sorted(files.folder.glob("layer_*-model_states.pt"))), None)
        state = files.get(layer.name) if layer is not None else first.get("module") or {}
    else:
        state = first.get("module") or {}
    tensor = next(iter(state.values()), None)
    return str(tensor.dtype).replace("torch.", "") if tensor is not None else "unknown"
