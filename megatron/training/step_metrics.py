"""Per-step metrics by name: what a step and its producers report, and how the loop reduces it.

A metric is a name and a `Metric(value, reduce)`: a float64 tensor (a scalar or any shape) on
the device, and how the ranks combine it.

- `SUM` metrics are summed over the data-parallel ranks at the next log boundary, every pending
  step's in one all-reduce (no host synchronisation per step): token counts, loss sums, UL2's
  per-kind sums, Mixture-of-Experts statistics.
- `MAX` metrics are maxed over every rank right after the step, in the one all-reduce that agrees
  on stopping: the exit conditions, the NaN guard, the divergence guard's numbers.

A producer is a function in the module that computes its numbers (denoiser_metrics.py,
moe_metrics.py, divergence.py, nan_locator.py) returning a `{name: Metric}` mapping; the step
and the loop merge the mappings, and reduce them flattened by name (sorted), so that no one
counts slots. Names are '/'-separated paths ('ul2/R/loss_sum'); every rank of a group must
report the same names (a producer reports its names always or never in a run): a `Reducer`
checks it the first time it meets a set of names.
"""

from __future__ import annotations

import zlib
from typing import Dict, List, Mapping, NamedTuple, Sequence, Tuple

import torch
import torch.distributed as dist

SUM = "sum"
MAX = "max"


class Metric(NamedTuple):
    value: torch.Tensor
    """float64, any shape, on the device."""
    reduce: str
    """SUM (over data-parallel ranks, at the log) or MAX (over all ranks, after the step)."""


Metrics = Dict[str, Metric]
Values = Dict[str, torch.Tensor]


class MetricNamesDiffer(RuntimeError):
    """The ranks of a group reported different metric names (a producer that reports on some
    ranks only): the flattened values would not line up."""


def metric(value, reduce: str, device=None) -> Metric:
    """A Metric of `value` (a tensor, or a Python number) as float64."""
    if reduce not in (SUM, MAX):
        raise ValueError(f"reduce must be {SUM!r} or {MAX!r}, got {reduce!r}")
    if not isinstance(value, torch.Tensor):
        value = torch.tensor(float(value), dtype=torch.float64, device=device)
    return Metric(value.detach().to(dtype=torch.float64), reduce)


def select(metrics: Mapping[str, Metric], reduce: str) -> Values:
    """The values of the metrics reduced by `reduce`."""
    return {name: m.value for name, m in metrics.items() if m.reduce == reduce}


def merge(*parts: Mapping[str, Metric]) -> Metrics:
    """One mapping of several producers' metrics; a name reported twice is an error."""
    out: Metrics = {}
    for part in parts:
        for name, m in part.items():
            if name in out:
                raise ValueError(f"metric {name!r} is reported twice")
            out[name] = m
    return out


def _layout(rows: Sequence[Mapping[str, torch.Tensor]]) -> Tuple:
    return tuple(tuple((name, tuple(row[name].shape)) for name in sorted(row)) for row in rows)


def _checksum(layout: Tuple) -> float:
    """crc32 of a layout's names and shapes (exact in float64)."""
    return float(zlib.crc32(repr(layout).encode()))


class Reducer:
    """Reduces mappings of metrics over a group, flattened by name, in one all-reduce per call.

    The first time a layout (the rows' names and shapes) is seen, one small all-reduce first
    checks that every rank of the group has the same layout: a rank with other names would
    otherwise join a collective of another size (a hang) or add unrelated numbers. Every rank
    takes the same decision (the check reduces the largest and the smallest layout checksum and
    size)."""

    def __init__(self, reduce: str, group=None, device=None, to_host: bool = False) -> None:
        """group: the process group (None: every rank); device: where the collective runs
        (None: the values' device); to_host: return the reduced values on the host, copied
        there at once (one synchronisation), for callers that read them all."""
        if reduce not in (SUM, MAX):
            raise ValueError(f"reduce must be {SUM!r} or {MAX!r}, got {reduce!r}")
        self.reduce, self.group, self.device, self.to_host = reduce, group, device, to_host
        self._checked = set()

    def __call__(self, rows: Sequence[Mapping[str, torch.Tensor]]) -> List[Values]:
        """Each mapping of `rows` (one per step) reduced, same names and shapes, in order.

        Raises:
            MetricNamesDiffer: some rank of the group reported other names (on every rank).
        """
        device = self.device or next((v.device for row in rows for v in row.values()),
                                     torch.device("cpu"))
        layout = _layout(rows)
        if layout not in self._checked:
            self._check(layout, device)
            self._checked.add(layout)
        parts = [row[name].reshape(-1).to(device=device, dtype=torch.float64)
                 for row, row_layout in zip(rows, layout) for name, _ in row_layout]
        if not parts:
            return [{} for _ in rows]
        flat = torch.cat(parts)
        op = dist.ReduceOp.SUM if self.reduce == SUM else dist.ReduceOp.MAX
        dist.all_reduce(flat, op=op, group=self.group)
        if self.to_host:
            flat = flat.cpu()
        out, at = [], 0
        for row_layout in layout:
            row = {}
            for name, shape in row_layout:
                n = int(torch.Size(shape).numel())
                row[name] = flat[at:at + n].reshape(shape)
                at += n
            out.append(row)
        return out

    def _check(self, layout: Tuple, device) -> None:
        size = float(sum(torch.Size(shape).numel() for row in layout for _, shape in row))
        mine = [size, _checksum(layout)]
        both = torch.tensor(mine + [-v for v in mine], dtype=torch.float64, device=device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
        high, low = both[:2].tolist(), [-v for v in both[2:].tolist()]
        if high != low:
            names = sorted({name for row in layout for name, _ in row})
            raise MetricNamesDiffer(
                f"the ranks reported different step metrics (this rank: "
                f"{', '.join(names) or 'none'}); every rank must report the same names")


def add_into(total: Dict[str, torch.Tensor], values: Mapping[str, torch.Tensor]) -> None:
    """Add `values` into `total` (an interval's sums), by name, on the host."""
    for name, value in values.items():
        value = value.detach().cpu()
        if name in total:
            total[name] += value
        else:
            total[name] = value.clone()
