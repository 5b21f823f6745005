"""What a run logged, as plain series.

A `Run` holds, per iteration, what the trainer's metrics line says (loss, lr, grad norm, tokens/s,
memory, step time, consumed samples), the evaluation losses and the per-layer gradient norms. The
readers (logfile.py for the `--log-file` text, events.py for TensorBoard) fill it start by start:
a resumed run logs several starts into one file (or one events file per start), and a later start
wins from the iteration it resumed at, so the steps it redid replace the ones the earlier start
logged (`Run.begin_start`). find.py says where a RUN argument's files are.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

TRAIN_METRICS = ("consumed_samples", "lr", "loss", "grad_norm", "loss_scale", "skipped",
                 "tokens_per_s", "target_tokens_per_s", "tflops_per_device", "mfu",
                 "memory_gib", "data_wait_s", "step_time_s")
"""The per-iteration values of the metrics line, under the names of `Run.train`."""

EVAL_SPLITS = ("valid", "test")


@dataclass
class Run:
    """One training run's logged series, with later starts already merged in."""

    label: str
    source: Path
    """The log file or TensorBoard folder the series were read from."""
    train: Dict[str, Dict[int, float]] = field(default_factory=dict)
    """metric (TRAIN_METRICS) -> {iteration: value}."""
    steps: Dict[int, int] = field(default_factory=dict)
    """iteration -> how many steps its metrics line covers (for the time axis)."""
    evals: Dict[str, Dict[int, float]] = field(default_factory=dict)
    """'valid' / 'test' -> {iteration: loss}."""
    layers: Dict[int, Dict[str, float]] = field(default_factory=dict)
    """iteration -> {layer group: gradient norm} (the per-layer grad norm lines)."""
    encoder_seq_length: Optional[int] = None
    """From the run's flags: turns consumed samples into tokens (None: not known)."""
    starts: int = 0
    """How many starts (launches) the source records."""

    def begin_start(self, resumed_at: int) -> None:
        """A new start that resumed at iteration `resumed_at` (0: from scratch): forget what
        earlier starts logged after it, since this start redoes those steps."""
        self.starts += 1
        for series in (*self.train.values(), *self.evals.values(), self.steps, self.layers):
            for it in [i for i in series if i > resumed_at]:
                del series[it]

    def add_train(self, iteration: int, values: Dict[str, float], steps: int) -> None:
        """One metrics line: `values` by TRAIN_METRICS name; `steps` it covers."""
        for key, value in values.items():
            self.train.setdefault(key, {})[iteration] = value
        self.steps[iteration] = max(int(steps), 1)

    def add_eval(self, iteration: int, split: str, loss: float) -> None:
        self.evals.setdefault(split, {})[iteration] = loss

    def add_layers(self, iteration: int, norms: Dict[str, float]) -> None:
        self.layers[iteration] = dict(norms)

    def last_train_iteration(self) -> int:
        """The highest iteration a metrics line was logged at (0 when none was)."""
        return max(self.steps, default=0)

    def series(self, metric: str) -> Tuple[List[int], List[float]]:
        """(iterations, values) of a train metric, in iteration order (empty if not logged)."""
        points = sorted(self.train.get(metric, {}).items())
        return [i for i, _ in points], [v for _, v in points]

    def x_values(self, iterations: Sequence[int], axis: str) -> List[float]:
        """The x coordinates of `iterations` on an axis: 'step' (the iteration), 'samples'
        (consumed samples), 'tokens' (consumed samples x encoder sequence length) or 'time'
        (hours in training steps: each metrics line's mean step time times the steps it covers,
        summed. A step time is rank 0's wall clock from the end of one step to the end of the
        next, data waits included; the trainer restarts that clock after an evaluation and a
        checkpoint save, so those, the start-up and the gaps between starts are left out: this
        is not the job's elapsed time).

        Iterations without a metrics line (an evaluation between log steps) are placed by
        linear interpolation between the neighbouring lines (extrapolation past the last).

        Raises:
            ValueError: an unknown axis, or 'tokens' without a known sequence length, or an
                axis the run logged nothing for.
        """
        if axis == "step":
            return [float(i) for i in iterations]
        if axis in ("samples", "tokens"):
            known = self.train.get("consumed_samples", {})
            if not known:
                raise ValueError(f"{self.source}: no consumed samples logged, so no x axis "
                                 f"in {axis}")
            scale = 1.0
            if axis == "tokens":
                if not self.encoder_seq_length:
                    raise ValueError(f"{self.source}: the encoder sequence length is not known "
                                     f"(no flags line; give the run's log file or --save "
                                     f"folder), so no x axis in tokens")
                scale = float(self.encoder_seq_length)
            return [scale * v for v in _interpolate(known, iterations)]
        if axis == "time":
            step_s = self.train.get("step_time_s", {})
            if not step_s:
                raise ValueError(f"{self.source}: no step times logged, so no x axis in time")
            hours, total = {}, 0.0
            for it in sorted(step_s):
                total += step_s[it] * self.steps.get(it, 1) / 3600.0
                hours[it] = total
            return _interpolate(hours, iterations)
        raise ValueError(f"unknown x axis {axis!r}; expected step, samples, tokens or time")


def _interpolate(known: Dict[int, float], iterations: Sequence[int]) -> List[float]:
    """known[i] where given, else linear between the neighbouring known iterations (from
    (0, 0) before the first; the last segment's slope after the last)."""
    its = [0] + sorted(i for i in known if i > 0)
    vals = [0.0] + [known[i] for i in its[1:]]
    out = []
    for it in iterations:
        if it in known:
            out.append(float(known[it]))
            continue
        j = min(max(bisect.bisect_left(its, it), 1), len(its) - 1)
        if j == 0 or its[j] == its[j - 1]:
            out.append(float(vals[-1]))
            continue
        slope = (vals[j] - vals[j - 1]) / (its[j] - its[j - 1])
        out.append(float(vals[j - 1] + slope * (it - its[j - 1])))
    return out


def is_events_file(path: Path) -> bool:
    return path.is_file() and "tfevents" in path.name


def events_files(folder: Path) -> List[Path]:
    """The TensorBoard events files directly in `folder`."""
    return sorted(p for p in folder.iterdir() if is_events_file(p)) if folder.is_dir() else []
