"""Per-layer gradient norms (--log-grad-norms-per-layer): the norm of each block's gradients.

Every parameter belongs to exactly one group, named after the Hugging Face T5 names:
`embedding` (shared.weight), `encoder.block.{i}` and `decoder.block.{i}` (everything under that
prefix, the relative attention bias of block 0 included), `encoder.final_layer_norm`,
`decoder.final_layer_norm` and, for an untied head, `lm_head`. So the squares of the group norms
sum to the square of the global gradient norm that the run logs.

The norms are taken where DeepSpeed takes the global one: after the backward and the gradient
reduction, before clipping and the optimizer step (`LayerGradNorms` wraps the engine's
`_take_model_step`, which the data-parallel engine and the pipeline engine both call at the
accumulation boundary). Each rank squares the gradient it holds, as DeepSpeed's norm does:

- ZeRO-0: the full, data-parallel-reduced `param.grad`; every data-parallel rank holds the same,
  so only data-parallel rank 0 counts it.
- ZeRO-1/2 and DeepSpeed's bf16 optimizer: this rank's fragment of each parameter (the tensor
  fragment mapping `param._hp_mapping`); the fragments of the data-parallel ranks are disjoint.
- ZeRO-3: this rank's partition of each parameter (`deepspeed.utils.safe_get_local_grad`).
- Tensor parallelism: a shard (`tensor_model_parallel`) counts on every tensor rank, a
  replicated weight (layer norms) on tensor rank 0 only.
- Pipeline: each stage counts its own blocks; the tied copies DeepSpeed marks
  `ds_pipe_replicated` (the embedding on the last stage, bias tables) are left out.

Then one all-reduce of the vector of per-group squares over all ranks; rank 0 logs it. Nothing of
this runs at steps that are not logged, nor without the flag.
"""

from __future__ import annotations

import re
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron import deepspeed_internals, parallel_state
from megatron.tensor_parallel.layers import counts_in_norm

_BLOCK = re.compile(r"^(encoder|decoder)\.block\.(\d+)\.")
TAG_PREFIX = "grad-norm-per-layer"


def layer_groups(num_layers: int, num_decoder_layers: int, tied_head: bool) -> List[str]:
    """The group names in log order: embedding, encoder blocks, encoder final norm, decoder
    blocks, decoder final norm, lm_head (untied heads only)."""
    groups = ["embedding"]
    groups += [f"encoder.block.{i}" for i in range(num_layers)] + ["encoder.final_layer_norm"]
    groups += [f"decoder.block.{i}" for i in range(num_decoder_layers)]
    groups += ["decoder.final_layer_norm"] + ([] if tied_head else ["lm_head"])
    return groups


def group_of(name: str) -> Optional[str]:
    """The group of a single-process (Hugging Face) parameter name; None for a name outside
    the T5 layout."""
    if name == "shared.weight":
        return "embedding"
    match = _BLOCK.match(name)
    if match:
        return f"{match.group(1)}.block.{match.group(2)}"
    for stack in ("encoder", "decoder"):
        if name.startswith(f"{stack}.final_layer_norm."):
            return f"{stack}.final_layer_norm"
    if name.startswith("lm_head."):
        return "lm_head"
    return None


def format_layer_norms(iteration: int, norms: Dict[str, float]) -> str:
    """The log line: ` grad norm per layer at iteration N: embedding 1.234E-01, ...`."""
    return (f" grad norm per layer at iteration {iteration}: "
            + ", ".join(f"{group} {value:.3E}" for group, value in norms.items()))


def write_layer_norms(writer, iteration: int, norms: Dict[str, float]) -> None:
    """The log line (print and --log-file) and TensorBoard scalars grad-norm-per-layer/<group>
    at x=iteration, through a MetricsWriter."""
    writer.write_text(format_layer_norms(iteration, norms))
    writer.write_scalars({f"{TAG_PREFIX}/{group}": value for group, value in norms.items()},
                         iteration)


def local_gradient_fragments(param) -> Iterator[torch.Tensor]:
    """The part of `param`'s reduced gradient that this rank holds under its optimizer (see the
    module docstring); nothing where it holds none. ZeRO-1/2 keep their gradients only between
    the backward at the accumulation boundary and the step."""
    if deepspeed_internals.is_zero3_parameter(param):  # this rank's partition (padding: 0)
        # DeepSpeed is imported where it runs: its import takes seconds and logs on stdout
        from deepspeed.utils import safe_get_local_grad

        grad = safe_get_local_grad(param)
        if grad is not None:
            yield grad
        return
    if deepspeed_internals.has_fragment_mapping(param):  # ZeRO-1/2, bf16 optimizer: the
        grad = deepspeed_internals.local_fragment_grad(param)  # fragment in this partition
        if grad is not None:
            yield grad
        return
    if param.grad is not None:
        yield param.grad


def _partitioned(param) -> bool:
    """The optimizer holds this parameter's gradient in data-parallel partitions."""
    return deepspeed_internals.is_zero3_parameter(param) or \
        deepspeed_internals.has_fragment_mapping(param)


class LayerGradNorms:
    """Takes the per-group gradient norms at the next optimizer step after `arm()` (collective:
    every rank steps together, and every rank must arm the same steps).

    Args:
        engine: DeepSpeed's engine (data-parallel or pipeline); its `_take_model_step` is wrapped.
        names: {this rank's parameter name: its single-process name}.
        groups: `layer_groups(...)`, the same on every rank.
        loss_scale: the current loss scale (the gradients are scaled by it under fp16).
        device: where the vector of squares lives (the all-reduce's device).
    Raises:
        ValueError: a parameter that belongs to no group (the model is not the T5 layout).
    """

    def __init__(self, engine, names: Dict[str, str], groups: List[str],
                 loss_scale: Callable[[], float], device: torch.device) -> None:
        self.groups, self.loss_scale, self.device = list(groups), loss_scale, device
        index = {g: i for i, g in enumerate(self.groups)}
        tensor_rank = parallel_state.get_tensor_model_parallel_rank()
        self._params: List[Tuple[torch.nn.Parameter, int]] = []
        for local_name, param in engine.module.named_parameters():
            full = names.get(local_name, local_name)
            group = group_of(full)
            if group not in index:
                raise ValueError(f"--log-grad-norms-per-layer: parameter {full} belongs to no "
                                 f"layer group (groups: {', '.join(self.groups)})")
            if param.requires_grad and counts_in_norm(param, tensor_rank):
                self._params.append((param, index[group]))
        self._armed = False
        self._squares: Optional[torch.Tensor] = None
        deepspeed_internals.wrap_model_step(engine, self._before_model_step)

    def _before_model_step(self) -> None:
        if self._armed:
            self._armed = False
            self._squares = self._measure()

    def arm(self) -> None:
        """Measure at the next optimizer step."""
        self._armed = True

    def take(self) -> Optional[Dict[str, float]]:
        """{group: norm} of the last measured step (then forgotten); None if none was."""
        squares, self._squares = self._squares, None
        if squares is None:
            return None
        return dict(zip(self.groups, squares.sqrt().tolist()))

    @torch.no_grad()
    def _measure(self) -> torch.Tensor:
        """The vector of per-group squares summed over all ranks (float64, on the device)."""
        squares = torch.zeros(len(self.groups), dtype=torch.float64, device=self.device)
        replica = parallel_state.get_data_parallel_rank() != 0
        for param, i in self._params:
            if replica and not _partitioned(param):
                continue  # the same full gradient is on data-parallel rank 0
            for grad in local_gradient_fragments(param):
                norm = torch.linalg.vector_norm(grad, dtype=torch.float32)
                squares[i] += norm.to(self.device, torch.float64) ** 2
        scale = float(self.loss_scale())
        if scale != 1.0:
            squares /= scale * scale
        dist.all_reduce(squares)
        return squares
