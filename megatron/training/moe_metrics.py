"""What the log shows of a Mixture-of-Experts run: per sparse layer, the balancing loss and the
z-loss (the unweighted values, means over the interval's forwards), the fraction of token
choices dropped by capacity, and the load of the busiest expert over the mean load (token
choices per expert, counted over every data-parallel rank's tokens); on the metrics line their
means over the layers (the load: the largest), in TensorBoard and the log file per layer too.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

from megatron import parallel_state
from megatron.model.moe import STAT_COLUMNS, take_stats
from megatron.training.step_metrics import SUM, Metric, Metrics

LAYER_LINE = " moe per layer at iteration {iteration}: {layers}"
"""The per-layer line (megatron/plot/logfile.py reads it)."""


def metrics(model, device) -> Tuple[Optional[List[str]], Metrics]:
    """This rank's sparse layers since the last take, as SUM step metrics 'moe/<layer>' (the
    layer's `take_stats` row, summed over the data-parallel ranks with the interval's other
    metrics), and the layer names in model order; names None: nothing to gather (a dense
    model without a pipeline; with a pipeline every stage joins `layers`)."""
    names, rows = take_stats(model, device)
    if rows is None and parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return None, {}
    if rows is None:
        return names, {}
    return names, {f"moe/{name}": Metric(row, SUM) for name, row in zip(names, rows)}


def layers(names: Optional[List[str]], reduced: Mapping[str, torch.Tensor]
           ) -> Optional[Dict[str, Dict[str, float]]]:
    """{layer name: {aux_loss, z_loss, dropped, max_load}} over the whole model from `metrics`'
    names and the reduced values (collective over the pipeline group: every stage's layers;
    every rank gets them), None for a dense model."""
    if names is None:
        return None
    rows = torch.stack([reduced[f"moe/{name}"] for name in names]) if names else None
    if parallel_state.get_pipeline_model_parallel_world_size() > 1 and dist.is_initialized():
        parts: List[Tuple[list, Optional[torch.Tensor]]] = \
            [None] * parallel_state.get_pipeline_model_parallel_world_size()
        dist.all_gather_object(parts, (names, None if rows is None else rows.cpu()),
                               group=parallel_state.get_pipeline_model_parallel_group())
        names = [n for part_names, _ in parts for n in part_names]
        kept = [r for _, r in parts if r is not None]
        rows = torch.cat(kept) if kept else None
    if rows is None:
        return None
    out = {}
    width = len(STAT_COLUMNS)
    for name, row in zip(names, rows.cpu().tolist()):
        calls, aux, z, dropped, choices = row[:width]
        load = row[width:]
        mean_load = sum(load) / len(load)
        out[name] = {"aux_loss": aux / calls if calls else 0.0,
                     "z_loss": z / calls if calls else 0.0,
                     "dropped": dropped / choices if choices else 0.0,
                     "max_load": max(load) / mean_load if mean_load else 0.0}
    return out


def layer_summary(layers: Dict[str, Dict[str, float]]) -> Dict[str, float]:
    """The metrics line's MoE fields: means over the layers, the largest load ratio."""
    values = list(layers.values())
    mean = lambda key: sum(v[key] for v in values) / len(values)  # noqa: E731
    return {"moe_aux_loss": mean("aux_loss"), "moe_z_loss": mean("z_loss"),
            "moe_dropped": mean("dropped"), "moe_max_load": max(v["max_load"] for v in values)}


def line_parts(summary: Mapping[str, object]) -> List[str]:
    """The metrics line's fields (metrics.format_line) of a Mixture-of-Experts run."""
    if summary.get("moe_aux_loss") is None:
        return []
    return [f"moe aux loss: {summary['moe_aux_loss']:.4E}",
            f"moe z loss: {summary['moe_z_loss']:.4E}",
            f"moe dropped: {summary['moe_dropped']:.4f}",
            f"moe max load: {summary['moe_max_load']:.3f}"]


def layer_line(iteration: int, layers: Dict[str, Dict[str, float]]) -> str:
    return LAYER_LINE.format(iteration=iteration, layers=", ".join(
        f"{name} aux {v['aux_loss']:.4E} z {v['z_loss']:.4E} dropped {v['dropped']:.4f} "
        f"max load {v['max_load']:.3f}" for name, v in layers.items()))


def layer_scalars(layers: Dict[str, Dict[str, float]]) -> Dict[str, float]:
    """TensorBoard tags moe/<layer>/<quantity>."""
    return {f"moe/{name}/{key}": value for name, v in layers.items() for key, value in v.items()}
