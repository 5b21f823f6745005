"""UL2's per-denoiser-kind losses as step metrics (docs/ul2.md).

A UL2 batch carries each sample's denoiser kind (`KIND_KEY`, an index into ul2.KINDS). The step
adds, per kind, the sum of the samples' token losses and their labelled tokens (`metrics`,
SUM metrics 'ul2/<kind>/loss_sum' and 'ul2/<kind>/tokens', zeros for data without kinds, so
that every rank reports the same names); the log shows each kind's token-weighted loss over the
interval (`summary_fields`: 'loss_R', 'loss_S', 'loss_X' where the kind had tokens).
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Tuple

import torch

from megatron.data.datasets.ul2 import KINDS
from megatron.training.step_metrics import SUM, Metric, Metrics

KIND_KEY = "denoiser_kind"
"""A UL2 batch's [batch] index of each sample's denoiser kind (ul2.KINDS)."""


def kind_sums(token_losses: torch.Tensor, labels: torch.Tensor,
              kinds: torch.Tensor) -> torch.Tensor:
    """float64 [len(KINDS), 2]: per denoiser kind, the sum of `token_losses` ([batch, length], 0
    where unlabelled) over the samples of that kind and their labelled tokens."""
    out = torch.zeros(len(KINDS), 2, dtype=torch.float64, device=token_losses.device)
    kinds = kinds.to(token_losses.device).long().reshape(-1)
    per_sample = torch.stack([token_losses.detach().double().sum(-1),
                              (labels != -100).sum(-1).double()], dim=-1)
    return out.index_add_(0, kinds, per_sample)


def zeros(device) -> torch.Tensor:
    """The sums of a step without kinds."""
    return torch.zeros(len(KINDS), 2, dtype=torch.float64, device=device)


def metrics(sums: torch.Tensor) -> Metrics:
    """The step metrics of a step's `kind_sums` (summed over its micro-batches)."""
    out = {}
    for k, kind in enumerate(KINDS):
        out[f"ul2/{kind}/loss_sum"] = Metric(sums[k, 0], SUM)
        out[f"ul2/{kind}/tokens"] = Metric(sums[k, 1], SUM)
    return out


def step_losses(values: Mapping[str, torch.Tensor]) -> Dict[str, Tuple[float, int]]:
    """{kind: (mean token loss, tokens)} of one reduced step, for the kinds it had."""
    out = {}
    for kind in KINDS:
        loss, tokens = _pair(values, kind)
        if tokens:
            out[kind] = (loss / tokens, int(tokens))
    return out


def summary_fields(interval: Mapping[str, torch.Tensor]) -> Dict[str, float]:
    """The log line's fields: the interval's token-weighted loss per kind that had tokens."""
    out = {}
    for kind in KINDS:
        loss, tokens = _pair(interval, kind)
        if tokens:
            out[f"loss_{kind}"] = loss / tokens
    return out


def line_parts(summary: Mapping[str, object]) -> List[str]:
    """The metrics line's fields (metrics.format_line): the loss per kind that had tokens."""
    return [f"loss {kind}: {summary[f'loss_{kind}']:.4E}" for kind in KINDS
            if summary.get(f"loss_{kind}") is not None]


def _pair(values: Mapping[str, torch.Tensor], kind: str) -> Tuple[float, Optional[float]]:
    tokens = values.get(f"ul2/{kind}/tokens")
    if tokens is None or float(tokens) <= 0:
        return 0.0, None
    return float(values[f"ul2/{kind}/loss_sum"]), float(tokens)
