"""`--load` of one of our checkpoints into a run of another layout, without a conversion step.

A checkpoint saved at one TP x PP (any split) x DP x EP and ZeRO stage loads into a run of
another: each rank reads its part of the weights, and of the fp32 masters and Adam's moments,
straight from the DeepSpeed files, and the run resumes with the iteration, consumed samples and
LR schedule of the checkpoint. The log says `resharding the checkpoint from TP a PP b DP c EP d
to TP e PP f DP g EP h`.

It is the offline route (`data_tools/convert_checkpoint.py --load DIR --to megatron OUT`, then
`--load OUT`) without the folder in between, bit for bit: the tensors are joined by the
converter's own code (formats/deepspeed_tensors.py `full_tensor`, over `tensor_rank_shards`), and
put into this rank's model and optimizer by the loader of converted checkpoints
(formats/weights.py `load_into`, io/optimizer_state.py) through `ShardedCheckpointReader`,
which answers that loader as `WeightsReader` answers it for a converted folder. As there, the
random generators start afresh (their states belong to the ranks of the saved layout).

Memory: a rank reads only the tensors its pipeline stage holds, one at a time, and of each
only the saved tensor ranks' shards that overlap its slice (`_overlapping`; the whole tensor,
joined as the converter does, where its run is not tensor-parallel or the tensor not split),
and of an expert weight only the saved expert ranks' parts holding its experts
(`_experts_kept`). The DeepSpeed files are memory-mapped, so a rank's resident memory is its
own model and optimizer plus about one tensor (and the file pages it touched, which the kernel
can drop).
A checkpoint holding a tuned prompt is not resharded (the layout refusal stands: convert it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from megatron.checkpoint.formats.deepspeed_experts import check_readable
from megatron.checkpoint.formats.deepspeed_files import CheckpointReadError, ExpertParts, \
    Files, Shard
from megatron.checkpoint.formats.deepspeed_tensors import (
    check_names,
    check_optimizer_states,
    full_tensor,
    model_source,
    tensor_rank_shards,
)
from megatron.checkpoint.formats.meta import META, kind_of, model_config
from megatron.checkpoint.formats.weights import MOMENTS, WeightsError
from megatron.failures import RunFailure
from megatron.model.meta import buffer_shapes, parameter_splits
from megatron.model.state_dict import VOCAB_PARAMETERS

RESHARDED = "resharded"
"""The key of the meta `load_resharded` returns that holds the log line saying so."""


class ReshardError(RunFailure):
    """A checkpoint that cannot be resharded into this run (the message names the file)."""


def reshardable(meta: Dict[str, Any]) -> bool:
    """Whether a checkpoint of ours (meta.json's contents) of another layout can be read into
    this run's: a model (not a weights folder, which loads anywhere already, nor one with a
    tuned prompt)."""
    if meta.get("format") == "weights" or "layout" not in meta:
        return False
    try:
        return kind_of(meta).prompt is None
    except (CheckpointReadError, ValueError, KeyError):
        return False


def reshard_problems(meta: Dict[str, Any], weights_only: bool, label: str) -> List[str]:
    """What a reshardable checkpoint (meta.json's contents) cannot give a run of another layout,
    found from meta.json alone (before any process starts): the optimizer states of fp16
    without ZeRO, which DeepSpeed's fp16 optimizer keeps without parameter names."""
    if weights_only or model_source(meta) != "weights":
        return []
    return [f"{label}: the checkpoint was saved in fp16 with ZeRO-0, whose optimizer states "
            f"cannot be resharded into another layout: resume in its layout "
            f"({sizes(meta['layout'])}, ZeRO {meta['layout']['zero_stage']}), or pass "
            f"--no-load-optim to load the weights alone"]


def sizes(layout: Dict[str, int]) -> str:
    """A layout's parallel sizes as the log says them: `TP a PP b DP c EP d`."""
    return (f"TP {layout['tensor_model_parallel_size']} "
            f"PP {layout['pipeline_model_parallel_size']} "
            f"DP {layout['data_parallel_size']} "
            f"EP {layout.get('expert_model_parallel_size', 1)}")


def layout_line(saved: Dict[str, int], now: Dict[str, int]) -> str:
    """The log line: `resharding the checkpoint from TP a PP b DP c EP d to TP e PP f DP g EP h`
    (and the ZeRO stages where they differ)."""
    zero = "" if saved["zero_stage"] == now["zero_stage"] else \
        f" (ZeRO {saved['zero_stage']} to {now['zero_stage']})"
    return f"resharding the checkpoint from {sizes(saved)} to {sizes(now)}{zero}"


class ShardedCheckpointReader:
    """Reads tensors, or slices of them, under our full names from a DeepSpeed iteration folder
    of ours, as formats/weights.py's `WeightsReader` reads a converted one: the weights
    ('model': the fp32 masters where the checkpoint has them) or an Adam moment ('exp_avg',
    'exp_avg_sq').

    Raises:
        CheckpointReadError: missing or foreign files, or tensors that do not fit the model
            meta.json describes (all tensor ranks' names are checked when it is made).
    """

    def __init__(self, folder: Path, prefix: str = "model", files: Optional[Files] = None,
                 meta: Optional[Dict[str, Any]] = None) -> None:
        from megatron.checkpoint.formats.meta import read_meta

        self.folder = Path(folder)
        self.single = f"{prefix} states of {META}'s layout"  # (named in the loaders' messages)
        self.meta = meta if meta is not None else read_meta(self.folder)
        self.config = model_config(self.meta, self.folder / META)
        check_readable(self.meta["layout"], self.folder)
        source = prefix if prefix in MOMENTS else model_source(self.meta)
        self.params = dict(parameter_splits(self.config))
        if prefix not in MOMENTS:  # persistent buffers (expert biases) have no moments
            self.params.update((n, (shape, None))
                               for n, shape in buffer_shapes(self.config).items())
        files = files or Files(self.folder)
        size = self.meta["layout"]["tensor_model_parallel_size"]
        self.shards = [tensor_rank_shards(files, self.meta, source, t, self.config)
                       for t in range(size)]
        for t, found in enumerate(self.shards):
            check_names(found, self.params, self.folder, t)

    def names(self) -> List[str]:
        return sorted(self.params)

    def slice(self, name: str, dim: Optional[int] = None, start: int = 0,
              stop: Optional[int] = None) -> torch.Tensor:
        """Tensor `name`, or its [start, stop) range along `dim`."""
        return self.region(name, {} if dim is None else {dim: (start, stop)})

    def region(self, name: str, ranges: Dict[int, Tuple[int, Optional[int]]]) -> torch.Tensor:
        """Tensor `name` restricted to [start, stop) along each dimension of `ranges`."""
        if name not in self.params:
            raise WeightsError(f"{self.folder}: no tensor {name!r}")
        try:
            shards, shape, ranges = self._experts_kept(name, ranges)
            picked = self._overlapping(name, shards, shape, ranges)
            if picked is not None:
                tensor, ranges = picked
            else:
                tensor = full_tensor(name, shape, self.params[name][1],
                                     [{name: shard} for shard in shards], self.meta,
                                     self.config, self.folder)
        except CheckpointReadError as e:
            raise WeightsError(str(e)) from None
        if not ranges:
            return tensor
        index = [slice(None)] * tensor.dim()
        for dim, (start, stop) in ranges.items():
            index[dim] = slice(start, stop)
        return tensor[tuple(index)].clone()  # (what was read is dropped)

    def _experts_kept(self, name: str, ranges: Dict[int, Tuple[int, Optional[int]]]):
        """(each saved tensor rank's Shard of `name`, the shape they make, `ranges`): of an
        expert weight asked for some experts (dim 0), the saved expert ranks' parts holding
        them alone, the experts' range made relative to them; else the whole shards."""
        shape = self.params[name][0]
        shards = [rank[name] for rank in self.shards]
        if 0 not in ranges or not all(isinstance(s, ExpertParts) for s in shards):
            return shards, shape, ranges
        count, (start, stop) = len(shards[0].parts), ranges[0]
        stop = shape[0] if stop is None else stop
        if shape[0] % count or stop <= start:
            return shards, shape, ranges
        per = shape[0] // count
        first, last = start // per, (stop - 1) // per
        kept = [ExpertParts(s.parts[first:last + 1]) for s in shards]
        return kept, (per * (last + 1 - first), *shape[1:]), \
            {**ranges, 0: (start - first * per, stop - first * per)}

    def _overlapping(self, name: str, shards: List[Shard], shape: Tuple[int, ...],
                     ranges: Dict[int, Tuple[int, Optional[int]]]):
        """(the `shards` (one per saved tensor rank, making `shape`) that overlap `ranges` along
        the tensor's split, joined; `ranges` relative to them), or None where the whole tensor
        is read: not split (or strided) over the saved tensor ranks, or asked whole along the
        split. The values are the same copies as `full_tensor`'s, of fewer shards."""
        split = self.params[name][1]
        size = len(shards)
        if split is None or split[1] != 1 or size == 1 or split[0] not in ranges:
            return None
        dim = split[0]
        whole = shape[dim]
        if name in VOCAB_PARAMETERS and dim == 0:  # saved padded for the saved TP
            divisible = int(self.meta["model"].get("make_vocab_size_divisible_by", 128))
            whole = self.config.padded_vocab_size(divisible, size)
        per = whole // size
        start, stop = ranges[dim]
        stop = shape[dim] if stop is None else stop
        if stop <= start or whole % size:
            return None
        first, last = start // per, (stop - 1) // per
        parts = [shards[t]() for t in range(first, last + 1)]
        want = tuple(per if d == dim else n for d, n in enumerate(shape))
        for t, part in zip(range(first, last + 1), parts):
            if tuple(part.shape) != want:
                raise CheckpointReadError(f"{self.folder}: tensor {name} of tensor rank {t} has "
                                          f"shape {tuple(part.shape)}; the model meta.json "
                                          f"describes has {want} on each of {size} ranks")
        tensor = torch.cat(parts, dim) if len(parts) > 1 else parts[0]
        return tensor, {**ranges, dim: (start - first * per, stop - first * per)}


def load_resharded(step, folder: Path, meta: Dict[str, Any], now: Dict[str, int],
                   weights_only: bool) -> Dict[str, Any]:
    """Load iteration folder `folder` (meta.json's contents `meta`, saved at another layout)
    into this run of layout `now` through `step` (training/step.py's `load_weights`): the
    weights, and unless `weights_only` the optimizer states with Adam's step. Returns `meta`
    with RESHARDED: the log line.

    Raises:
        ReshardError: files that cannot be read, or optimizer states that cannot be carried.
    """
    try:
        files = Files(folder)  # (one memory map of each file for the three readers)
        readers = {"model": ShardedCheckpointReader(folder, "model", files, meta)}
        optimizer_step = None
        if not weights_only:
            optimizer_step = check_optimizer_states(folder)
            readers.update((k, ShardedCheckpointReader(folder, k, files, meta)) for k in MOMENTS)
        step.load_weights(folder, optimizer_step=optimizer_step,
                          open_reader=lambda _folder, prefix="model": readers[prefix])
    except (CheckpointReadError, WeightsError) as e:
        hint = "" if weights_only else \
            " (--no-load-optim loads the weights alone, where the optimizer states are the cause)"
        raise ReshardError(f"--load {folder.parent}: the checkpoint cannot be resharded into "
                           f"this layout: {e}{hint}", rank_local=True) from None
    return {**meta, RESHARDED: layout_line(meta["layout"], now)}
