"""The step-metric producers whose numbers reach the log line and TensorBoard, in line order.

A producer is the module that computes some step metrics (step_metrics.py). Beside the
function that reports them (called where they are computed: the step, its loss function, the
model), it may define
- `summary_fields(interval)`: its fields of the log interval ({summary key: number}; TensorBoard
  writes each as train/<key>), from `interval`, the interval's reduced SUM metrics summed by
  name;
- `line_parts(summary)`: its fields on the metrics line (metrics.format_line), as text.
Adding a metric to the log is its producer module and one entry here.
"""

from __future__ import annotations

from typing import Dict, List, Mapping

import torch

from megatron.training import denoiser_metrics, moe_metrics

PRODUCERS = (denoiser_metrics, moe_metrics)


def summary_fields(interval: Mapping[str, torch.Tensor]) -> Dict[str, float]:
    out: Dict[str, float] = {}
    for producer in PRODUCERS:
        if hasattr(producer, "summary_fields"):
            out.update(producer.summary_fields(interval))
    return out


def line_parts(summary: Mapping[str, object]) -> List[str]:
    parts: List[str] = []
    for producer in PRODUCERS:
        if hasattr(producer, "line_parts"):
            parts += producer.line_parts(summary)
    return parts
