"""Checkpoints of full tensors: what the conversion tool writes for the trainer to start from.

    OUT/latest_checkpointed_iteration.txt
    OUT/iter_NNNNNNN/meta.json                    "format": "weights", the model, the source
    OUT/iter_NNNNNNN/model.safetensors            full, unpadded tensors under our names
        (or model-0000K-of-0000N.safetensors with model.safetensors.index.json)
    OUT/iter_NNNNNNN/exp_avg.safetensors, exp_avg_sq.safetensors
                                                  with optimizer states: Adam's moments, fp32,
                                                  named and sharded as the weights

The tensors are whole, so the checkpoint fits any layout: every rank reads only its tensor-
parallel slice of the tensors its pipeline stage holds, and of each expert weight ([experts,
...]) its expert rank's experts (safetensors reads slices from the mapped file); ZeRO-3 ranks
load through DeepSpeed's gathered parameters. Persistent buffers (the expert biases of
`moe_expert_bias`) are stored beside the weights, whole, without optimizer states. The target
sizes given to the tool are recorded in meta.json and checked nowhere (but that the experts
divide by the expert-parallel size): any TP x PP x EP x DP and ZeRO stage can load it.

Without optimizer states the trainer takes it with `--load OUT --finetune` (weights only: a
fresh optimizer, LR schedule and data position). With them (converted from one of our
checkpoints), model.safetensors holds the fp32 masters, meta.json carries Adam's step count and
what a resume needs (iteration, consumed samples, the LR schedule), and `--load OUT` resumes the
run in the new layout (megatron/checkpoint/io/optimizer_state.py puts the states into DeepSpeed's
optimizer).

Written to OUT.tmp and renamed; the tracker is written last.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch
from safetensors import safe_open

from megatron.checkpoint.formats.hf import ShardWriter, parse_size, staged_folder
from megatron.checkpoint.formats.meta import kind_of, write_meta
from megatron.checkpoint.layout import iteration_folder_name, write_tracker
from megatron.deepspeed_internals import full_shape, gathered_for_write

FORMAT = "weights"
MOMENTS = ("exp_avg", "exp_avg_sq")
VOCAB_PARAMETERS = ("shared.weight", "lm_head.weight")


class WeightsError(ValueError):
    """A weights checkpoint that cannot be written or read; the message names the file."""


def write_weights_checkpoint(out: Path, tensors: Iterable[Tuple[str, torch.Tensor]],
                             model_meta: Dict[str, Any], iteration: int = 0,
                             source: Optional[Dict[str, Any]] = None,
                             target_layout: Optional[Dict[str, int]] = None,
                             max_shard_size="5GB", force: bool = False,
                             progress: Optional[Callable[[str], None]] = None,
                             optimizer: Optional[Dict[str, Any]] = None) -> Path:
    """Write OUT (see the module docstring) from full tensors given one at a time.

    optimizer: with optimizer states, {'step': Adam's step count, 'exp_avg' and 'exp_avg_sq':
        iterables of (name, full fp32 tensor) for the same names as `tensors` (but the
        persistent buffers, which have none), 'resume': the source's iteration,
        consumed_samples and lr_schedule} (`tensors` are then the masters).
    """
    out = Path(out)
    if out.exists() and not force:
        raise WeightsError(f"{out} exists; pass --force to replace it")
    with staged_folder(out) as tmp:
        folder = tmp / iteration_folder_name(iteration)
        folder.mkdir()
        names, count = _write_tensors(folder, "model", tensors, max_shard_size, progress)
        meta = {"format": FORMAT, "iteration": iteration, "consumed_samples": 0,
                "model": model_meta, "parameters": count,
                "layout": target_layout or {}, "source": source or {},
                "saved_at": time.strftime("%Y-%m-%d %H:%M:%S")}
        if optimizer is not None:
            stateful = [n for n in names if n not in _buffer_names(model_meta)]
            for key in MOMENTS:
                got, _ = _write_tensors(folder, key, optimizer[key], max_shard_size, progress)
                if got != stateful:
                    missing = sorted(set(stateful) - set(got)) or sorted(set(got) - set(stateful))
                    raise WeightsError(f"{key}: the optimizer state does not name the weights' "
                                       f"tensors ({', '.join(missing[:4])} ...)")
            resume = optimizer.get("resume") or {}
            meta.update(consumed_samples=resume.get("consumed_samples", 0),
                        lr_schedule=resume.get("lr_schedule"),
                        optimizer={"step": int(optimizer["step"]), "states": list(MOMENTS)})
        meta["files"] = sorted(p.name for p in folder.iterdir())
        write_meta(folder, meta, kind_of(meta))
        write_tracker(tmp, iteration)
    return out


def _buffer_names(model_meta: Dict[str, Any]) -> set:
    """The model's persistent buffers (expert biases): weights without optimizer states."""
    from megatron.model.config import T5Config
    from megatron.model.meta import buffer_shapes

    return set(buffer_shapes(T5Config.from_dict(model_meta["config"])))


def _write_tensors(folder: Path, prefix: str, tensors: Iterable[Tuple[str, torch.Tensor]],
                   max_shard_size, progress) -> Tuple[List[str], int]:
    """PREFIX.safetensors (or its shards and index) in `folder`; (names in order, elements)."""
    writer = ShardWriter(folder, parse_size(max_shard_size), prefix=prefix)
    names, count = [], 0
    for name, tensor in tensors:
        writer.add(name, tensor)
        names.append(name)
        count += tensor.numel()
        if progress:
            progress(name)
    writer.close()
    return names, count


def is_weights_checkpoint(meta: Dict[str, Any]) -> bool:
    return meta.get("format") == FORMAT


class WeightsReader:
    """Reads tensors, or slices of them, from a weights checkpoint's iteration folder: the
    weights ('model'), or with `prefix` an optimizer state ('exp_avg', 'exp_avg_sq')."""

    def __init__(self, folder: Path, prefix: str = "model") -> None:
        self.folder = Path(folder)
        self.single = f"{prefix}.safetensors"
        index = self.folder / f"{prefix}.safetensors.index.json"
        if index.is_file():
            try:
                self.weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError) as e:
                raise WeightsError(f"{index}: unreadable ({e})") from None
        elif (self.folder / self.single).is_file():
            self.weight_map = None
        else:
            raise WeightsError(f"{self.folder}: no {self.single} or {index.name}")
        self._open: Dict[str, Any] = {}

    def names(self) -> List[str]:
        if self.weight_map is not None:
            return sorted(self.weight_map)
        return sorted(self._file(self.single).keys())

    def _file(self, name: str):
        if name not in self._open:
            path = self.folder / name
            try:
                self._open[name] = safe_open(str(path), framework="pt")
            except Exception as e:  # noqa: BLE001 - safetensors raises its own types
                raise WeightsError(f"{path}: not a readable safetensors file ({e})") from None
        return self._open[name]

    def slice(self, name: str, dim: Optional[int] = None, start: int = 0,
              stop: Optional[int] = None) -> torch.Tensor:
        """Tensor `name`, or its [start, stop) range along `dim`."""
        return self.region(name, {} if dim is None else {dim: (start, stop)})

    def region(self, name: str, ranges: Dict[int, Tuple[int, Optional[int]]]) -> torch.Tensor:
        """Tensor `name` restricted to [start, stop) along each dimension of `ranges`."""
        file = self.single if self.weight_map is None else self.weight_map.get(name)
        if file is None or name not in self._file(file).keys():
            raise WeightsError(f"{self.folder}: no tensor {name!r}")
        try:
            view = self._file(file).get_slice(name)
            if not ranges:
                return view[:]
            index = [slice(None)] * len(view.get_shape())
            for dim, (start, stop) in ranges.items():
                index[dim] = slice(start, stop)
            return view[tuple(index)]
        except WeightsError:
            raise
        except Exception as e:  # noqa: BLE001
            raise WeightsError(f"{self.folder / file}: tensor {name!r} unreadable ({e})") \
                from None


def load_into(module: torch.nn.Module, names: Dict[str, str], reader: WeightsReader,
              vocab_size: int, tensor_rank: int, tensor_size: int,
              buffers: Optional[Dict[str, str]] = None,
              experts: Tuple[int, int] = (0, 1)) -> List[str]:
    """Copy each parameter of `module` (its name -> our full name in `names`) from the reader:
    this tensor rank's slice, vocabulary rows padded with zeros, and of an expert weight this
    expert rank's experts (`experts`: (expert rank, expert-parallel size)). Under ZeRO-3 the
    parameters are gathered around the copy (every data-parallel rank reads the same values).
    `buffers` (its name -> our full name) are copied whole. Returns the problems (missing
    tensors, shapes), all of them; nothing is copied when there are any."""
    plan, problems = [], []
    params = dict(module.named_parameters())
    state = module.state_dict(keep_vars=True) if buffers else {}
    available = set(reader.names())
    for local, full in [*names.items(), *(buffers or {}).items()]:
        if full not in available:
            problems.append(f"{reader.folder}: no tensor {full!r} (for {local})")
            continue
        plan.append((params[local] if local in params else state[local], full))
    if problems:
        return problems
    for param, full in plan:
        problem = _copy(param, full, reader, vocab_size, tensor_rank, tensor_size, experts)
        if problem:
            problems.append(problem)
    return problems


def _copy(param, full: str, reader: WeightsReader, vocab_size: int, tensor_rank: int,
          tensor_size: int, experts: Tuple[int, int] = (0, 1)) -> Optional[str]:
    context = gathered_for_write(param)  # ZeRO-3: whole while written, then partitioned
    with context:
        if getattr(param, "partition_stride", 1) != 1:
            return f"{full}: strided tensor-parallel shards are not supported"
        tensor = local_tensor(param, full, reader, vocab_size, tensor_rank, tensor_size,
                              *experts)
        if tuple(tensor.shape) != tuple(param.shape):
            return (f"{reader.folder}: tensor {full!r} has shape {tuple(tensor.shape)}, this "
                    f"rank's parameter {tuple(param.shape)}: another model")
        with torch.no_grad():
            param.data.copy_(tensor.to(param.dtype))
    return None


def local_tensor(param, full: str, reader: WeightsReader, vocab_size: int, rank: int,
                  size: int, expert_rank: int = 0, expert_size: int = 1) -> torch.Tensor:
    """This rank's part of tensor `full`: its slice along the partition dimension (all our
    layers shard with stride 1); vocabulary rows beyond vocab_size are padding, zero. Of an
    expert weight ([experts, ...], `param.expert_parallel`) also this expert rank's experts."""
    sharded = getattr(param, "tensor_model_parallel", False) and size > 1
    dim = param.partition_dim if sharded else 0
    shape = _shape(param)
    length = shape[dim]
    start = rank * length if sharded else 0
    if full in VOCAB_PARAMETERS and dim == 0:
        tensor = reader.slice(full, 0, min(start, vocab_size), min(start + length, vocab_size))
        if tensor.shape[0] < length:
            tensor = torch.cat([tensor, tensor.new_zeros(length - tensor.shape[0],
                                                         *tensor.shape[1:])])
        return tensor
    ranges = {dim: (start, start + length)} if sharded else {}
    if getattr(param, "expert_parallel", False) and expert_size > 1:  # (never split on dim 0
        ranges[0] = (expert_rank * shape[0], (expert_rank + 1) * shape[0])  # by tensor ranks)
    return reader.region(full, ranges)


def _shape(param) -> Tuple[int, ...]:
    """A parameter's shape on this rank; under ZeRO-3 (partitioned, empty) DeepSpeed's record."""
    return full_shape(param)


def full_tensors(reader: WeightsReader) -> Iterator[Tuple[str, torch.Tensor]]:
    for name in reader.names():
        yield name, reader.slice(name)
