"""DeepSpeed's checkpoint files, read safely: the memory-mapped loader with its allow-list, the
files' names, and how the fp32 masters of ZeRO 1-3 are laid out (megatron/checkpoint/formats/deepspeed.py
is the reader built on these).

The masters (learnt from deepspeed/utils/zero_to_fp32.py and the optimizers' state_dict; our own
code, which reads one tensor rank and stage at a time and never joins whole partitions):

- ZeRO-1/2 (DeepSpeedZeroOptimizer; bf16 without a pipeline too): per group g, the ranks'
  'single_partition_of_fp32_groups'[g] back to back are the group's flat copy: the parameters of
  the model file's param_shapes[g] in order, each followed by param_alignment_paddings[g][i]
  elements. The group's trailing padding is stripped before saving.
- BF16_Optimizer (bf16 ZeRO-1 with a pipeline): the same without per-parameter padding; the
  trailing padding ('group_paddings', per rank) is saved.
- ZeRO-3: every rank holds ceil(numel / D) elements of every parameter (param_shapes order, the
  last rank zero-padded), back to back over its 'fp32_flat_groups'.
- Experts split over EP ranks (ZeRO-1/2): their groups ('moe' in the base optimizer's
  param_groups, DeepSpeed's `ep_size_EP` groups) are partitioned over the expert-data-parallel
  group, so a group's flat copy is the partitions of data ranks e, e + EP, e + 2 EP, ... for
  expert rank e, each copy laid out by the same param_shapes (the local [E / EP, ...] shapes).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import pickle
import re
from functools import partial
from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence

import torch

ALLOWED_GLOBALS = ("deepspeed.runtime.fp16.loss_scaler.LossScaler",
                   "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
                   "deepspeed.runtime.zero.config.ZeroStageEnum",
                   "deepspeed.utils.tensor_fragment.fragment_address")
"""The classes DeepSpeed pickles into optimizer files beside tensors and plain values: the loss
scaler (static; dynamic under fp16), the ZeRO stage, the fragment addresses of
param_slice_mappings."""

OPTIMIZER_PARAMETERS = "optimizer_parameters"
"""What the trainer saves beside a plain torch optimizer's state (ZeRO-0, in the model-states
file): its parameters' names, group by group, in its order; torch's state_dict numbers them
only (training/step.py writes it, deepspeed.py reads it)."""

Shard = Callable[[], torch.Tensor]
"""Reads one tensor rank's part of a parameter (a new tensor) when called."""


class CheckpointReadError(ValueError):
    """A checkpoint that cannot be read; the message names the file (and the tensor)."""


def allowed_globals() -> list:
    """The classes named by ALLOWED_GLOBALS (imported from DeepSpeed when a file is opened)."""
    # DeepSpeed is imported where it runs: its import takes seconds and logs on stdout
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


@contextlib.contextmanager
def only_globals(classes):
    """Exactly `classes` allowed while loading: globals another library registered for the
    whole process (megatron-core adds argparse.Namespace, for one) are set aside meanwhile."""
    registered = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        with torch.serialization.safe_globals(classes):
            yield
    finally:
        torch.serialization.add_safe_globals(registered)


def load_file(path: Path) -> Any:
    """A DeepSpeed file, memory-mapped (tensors are read when touched), `ALLOWED_GLOBALS` only.

    Raises:
        CheckpointReadError: missing, truncated or damaged, or holding another object.
    """
    if not path.is_file():
        raise CheckpointReadError(f"{path}: missing; the checkpoint is incomplete")
    try:
        with only_globals(allowed_globals()):
            return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = found.group(1) if found else str(e).splitlines()[0]
        raise CheckpointReadError(f"{path}: holds {what}, which this reader does not load (it "
                                  f"allows tensors, plain values and {', '.join(ALLOWED_GLOBALS)})"
                                  ) from None
    except (RuntimeError, OSError, EOFError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointReadError(f"{path}: cannot be read ({first}); the file is truncated or "
                                  f"damaged") from None


class Files:
    """The files of one iteration folder, each loaded once per read. They are memory-mapped:
    holding them open costs only the pages read, which the kernel can drop (clean file pages)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._loaded: Dict[str, Any] = {}

    def get(self, name: str) -> Any:
        if name not in self._loaded:
            self._loaded[name] = load_file(self.folder / name)
        return self._loaded[name]

    def field(self, name: str, key: str) -> Any:
        value = self.get(name)
        if not isinstance(value, dict) or key not in value or value[key] is None:
            raise CheckpointReadError(f"{self.folder / name}: no {key!r}: not the DeepSpeed file "
                                      f"that meta.json's layout implies")
        return value[key]

    def zero_name(self, dp_rank: int, model_rank: int, bf16: bool) -> str:
        """A ZeRO optimizer file's name ('bf16_' whenever bf16 is on; the other spelling is
        taken if that one is absent)."""
        names = [f"{p}zero_pp_rank_{dp_rank}_mp_rank_{model_rank:02d}_optim_states.pt"
                 for p in (("bf16_", "") if bf16 else ("", "bf16_"))]
        return next((n for n in names if (self.folder / n).is_file()), names[0])


def model_file(model_rank: int, layout: Dict[str, int]) -> str:
    """The engine's model-states file of DeepSpeed's model-parallel rank `model_rank`."""
    if layout["zero_stage"] == 3:  # one per data-parallel rank; rank 0's has the shapes
        return f"zero_pp_rank_0_mp_rank_{model_rank:02d}_model_states.pt"
    return f"mp_rank_{model_rank:02d}_model_states.pt"


# ZeRO masters ---------------------------------------------------------------------------------
class Flat:
    """1-D tensors read as one (a group's partitions over the ranks, or one rank's groups back
    to back) without joining them: `read` copies out only the range asked for."""

    def __init__(self, parts: Sequence[torch.Tensor]) -> None:
        self.parts = [p.reshape(-1) for p in parts]
        self.starts = list(itertools.accumulate([p.numel() for p in self.parts], initial=0))

    def __len__(self) -> int:
        return self.starts[-1]

    def read(self, start: int, numel: int) -> torch.Tensor:
        stop = start + numel
        pieces = [part[max(start, lo) - lo:min(stop, lo + part.numel()) - lo]
                  for part, lo in zip(self.parts, self.starts)
                  if lo < stop and lo + part.numel() > start]
        out = torch.cat(pieces) if pieces else self.parts[0].new_empty(0)
        if out.numel() != numel:
            raise IndexError(f"elements {start}..{stop} of {len(self)}")
        return out


def zero_masters(files: Files, layout: Dict[str, int], model_rank: int, bf16: bool,
                 key: str = "fp32") -> Dict[str, Shard]:
    """{DeepSpeed's parameter name: its fp32 master on this model rank} from the ZeRO files of
    every data-parallel rank; with `key` 'exp_avg' or 'exp_avg_sq', that Adam moment instead
    (the optimizer keeps its states in flat partitions laid out as the masters'). With experts
    split over ranks, an expert weight's master is every expert rank's joined (all experts)."""
    shapes = files.field(model_file(model_rank, layout), "param_shapes")
    names = [files.zero_name(d, model_rank, bf16) for d in range(layout["data_parallel_size"])]
    states = [files.field(n, "optimizer_state_dict") for n in names]
    first = states[0]
    count = first.get("partition_count")
    count = max(count) if isinstance(count, (list, tuple)) else count
    if count != len(names):
        raise CheckpointReadError(f"{files.folder / names[0]}: partitioned over {count} ranks; "
                                  f"meta.json's layout has {len(names)}")
    where = f"{files.folder / names[0]} (and its {len(names) - 1} data-parallel siblings)"
    if key != "fp32":
        states = [_with_moment(s, key, f"{files.folder / n}") for s, n in zip(states, names)]
    if layout["zero_stage"] == 3:
        return _zero3(shapes, states, where)
    return _zero12(shapes, states, where, layout.get("expert_model_parallel_size", 1) or 1)


def _with_moment(state: Dict[str, Any], key: str, where: str) -> Dict[str, Any]:
    """`state` with its flat masters replaced by the optimizer's `key` partitions, group by
    group (ZeRO-1/2 and the BF16 optimizer keep the base optimizer's state under
    'base_optimizer_state', ZeRO-3 under 'optimizer_state_dict'; one entry per flat group)."""
    masters = "fp32_flat_groups" if "fp32_flat_groups" in state \
        else "single_partition_of_fp32_groups"
    base = state.get("optimizer_state_dict" if masters == "fp32_flat_groups"
                     else "base_optimizer_state")
    groups = base.get("state") if isinstance(base, dict) else None
    count = len(state.get(masters) or ())
    if not isinstance(groups, dict) or sorted(groups) != list(range(count)) \
            or not all(isinstance(g, dict) and torch.is_tensor(g.get(key))
                       for g in groups.values()):
        raise CheckpointReadError(f"{where}: no optimizer state {key!r} for each of its {count} "
                                  f"flat groups (an optimizer other than Adam, or a checkpoint "
                                  f"saved before its first step)")
    return {**state, masters: [groups[g][key] for g in range(count)]}


def _zero12(shapes: List[Dict[str, Any]], states: List[Dict[str, Any]], where: str,
            expert_size: int = 1) -> Dict[str, Shard]:
    key = "single_partition_of_fp32_groups"
    first = states[0]
    if key not in first:
        raise CheckpointReadError(f"{where}: no {key!r}: not a ZeRO 1/2 optimizer file (is "
                                  f"meta.json's zero_stage right?)")
    # BF16_Optimizer (no 'zero_stage' in its state) saves the trailing padding; ZeRO 1/2 not.
    trailing_saved = "zero_stage" not in first
    paddings = first.get("param_alignment_paddings") or [None] * len(shapes)
    if len(first[key]) != len(shapes):
        raise CheckpointReadError(f"{where}: {len(first[key])} parameter groups; the model "
                                  f"file's param_shapes has {len(shapes)}")
    experts = moe_groups(first, len(shapes))
    if expert_size > 1 and not any(experts):
        raise CheckpointReadError(f"{where}: no expert parameter group ('moe'), though "
                                  f"meta.json's layout splits the experts over {expert_size} "
                                  f"ranks")
    out = {}
    for g, group in enumerate(shapes):
        copies = [[states[d] for d in ranks]
                  for ranks in replica_ranks(len(states), expert_size, experts[g])]
        _check_partitions(copies[0][0], g, len(copies[0]), where)
        flats = [Flat([s[key][g] for s in copy]) for copy in copies]
        offset = 0
        pads = paddings[g] or [0] * len(group)
        if len(pads) != len(group):
            raise CheckpointReadError(f"{where}: {len(pads)} alignment paddings for the "
                                      f"{len(group)} parameters of group {g}")
        for (name, shape), pad in zip(group.items(), pads):
            numel = math.prod(shape)
            reads = [partial(_read_flat, flat, offset, numel, tuple(shape), name, where)
                     for flat in flats]
            # an expert group: each expert rank's experts, joined along the experts dimension
            out[name] = reads[0] if len(reads) == 1 else ExpertParts(reads)
            offset += numel + pad
        for copy, flat in zip(copies, flats):
            trailing = sum(s["group_paddings"][g] for s in copy) if trailing_saved else 0
            if offset + trailing != len(flat):
                raise CheckpointReadError(f"{where}: group {g} holds {len(flat)} elements; its "
                                          f"parameters need {offset} (+{trailing} padding): "
                                          f"files of different checkpoints or layouts?")
    return out


def moe_groups(state: Dict[str, Any], count: int) -> List[bool]:
    """Which of a ZeRO-1/2 file's `count` parameter groups hold experts (DeepSpeed's `moe`
    groups: 'moe' in the base optimizer's param_groups)."""
    base = state.get("base_optimizer_state")
    groups = base.get("param_groups") if isinstance(base, dict) else None
    if not isinstance(groups, list) or len(groups) != count:
        return [False] * count
    return [bool(isinstance(g, dict) and g.get("moe")) for g in groups]


def replica_ranks(data_size: int, expert_size: int, is_moe: bool) -> List[List[int]]:
    """The data ranks whose partitions, in order, make up one flat copy of a group: all ranks
    for a dense group; for an expert group (partitioned over the expert-data-parallel group),
    each expert rank's: the data ranks equal to it modulo EP, expert rank 0's first."""
    if not is_moe or expert_size == 1:
        return [list(range(data_size))]
    return [list(range(e, data_size, expert_size)) for e in range(expert_size)]


def _check_partitions(state: Dict[str, Any], group: int, ranks: int, where: str) -> None:
    count = state.get("partition_count")
    if isinstance(count, (list, tuple)) and len(count) > group and count[group] != ranks:
        raise CheckpointReadError(f"{where}: group {group} is partitioned over {count[group]} "
                                  f"ranks; meta.json's layout gives it {ranks}")


class ExpertParts:
    """An expert weight's Shard: each saved expert rank's [E / EP, ...] part, joined into one
    [E, ...] tensor when called. `parts` (in expert-rank order) can be read alone: a run of
    another layout reads only the experts it keeps (megatron/checkpoint/io/reshard.py)."""

    def __init__(self, parts: Sequence[Shard]) -> None:
        self.parts = list(parts)

    def __call__(self) -> torch.Tensor:
        return torch.cat([part() for part in self.parts])


def _zero3(shapes: List[Dict[str, Any]], states: List[Dict[str, Any]],
           where: str) -> Dict[str, Shard]:
    key = "fp32_flat_groups"
    if key not in states[0]:
        raise CheckpointReadError(f"{where}: no {key!r}: not a ZeRO-3 optimizer file (is "
                                  f"meta.json's zero_stage right?)")
    ranks = [Flat(list(s[key])) for s in states]
    out, offset = {}, 0
    for group in shapes:
        for name, shape in group.items():
            numel = math.prod(shape)
            part = math.ceil(numel / len(ranks))
            out[name] = partial(_read_zero3, ranks, offset, part, numel, tuple(shape), name,
                                where)
            offset += part
    if any(len(r) != offset for r in ranks):
        raise CheckpointReadError(f"{where}: ranks hold {[len(r) for r in ranks]} elements; "
                                  f"the parameters need {offset} each: files of different "
                                  f"checkpoints or layouts?")
    return out


def _read_flat(flat: Flat, offset: int, numel: int, shape, name: str, where: str):
    try:
        return flat.read(offset, numel).view(shape)
    except (IndexError, RuntimeError) as e:
        raise CheckpointReadError(f"{where}: tensor {name}: {e}") from None


def _read_zero3(ranks: List[Flat], offset: int, part: int, numel: int, shape, name: str,
                where: str):
    try:
        return torch.cat([r.read(offset, part) for r in ranks])[:numel].view(shape)
    except (IndexError, RuntimeError) as e:
        raise CheckpointReadError(f"{where}: tensor {name}: {e}") from None

