"""The divergence guard's flags (megatron/training/divergence.py has the checks): their
definitions, their problems, and the typed `DivergenceConfig` they give."""

from __future__ import annotations

import argparse
import math
from typing import List, Mapping

from megatron.config.training import DivergenceConfig

_THRESHOLD_FLAGS = {
    "divergence_loss_spike_factor": "loss_spike_factor",
    "divergence_loss_window": "loss_window",
    "divergence_zero_grad_steps": "zero_grad_steps",
    "divergence_weight_growth": "weight_growth",
}


def add_divergence_args(group) -> None:
    """The guard's flags, in the parser group `group` (next to the NaN guard's)."""
    d = DivergenceConfig()
    group.add_argument(
        "--check-for-divergence", dest="check_for_divergence",
        action=argparse.BooleanOptionalAction, default=True,
        help="stop with exit 1, without saving, when a run diverges while its loss and gradient "
             "norm stay finite: a weight tensor grows too fast, the gradient norm is exactly 0 "
             "on consecutive steps, or the loss spikes above its running mean (default on; the "
             "three --divergence-* flags set the thresholds). Interval saves are committed "
             "once the next step has passed the checks, so the tracker names the last healthy "
             "checkpoint")
    group.add_argument(
        "--divergence-weight-growth", type=float, default=None, metavar="FACTOR",
        help=f"stop when the norm of a weight tensor (a rank's part of it) grows by more than "
             f"this factor in one step (default {d.weight_growth:g}; 0: off)")
    group.add_argument(
        "--divergence-zero-grad-steps", type=int, default=None, metavar="N",
        help=f"stop after N consecutive steps whose gradient norm is exactly 0 (default "
             f"{d.zero_grad_steps}; 0: off; fp16 steps that overflowed are not counted)")
    group.add_argument(
        "--divergence-loss-spike-factor", type=float, default=None, metavar="FACTOR",
        help=f"stop when a step's loss is more than FACTOR times the mean loss of the previous "
             f"--divergence-loss-window steps (default {d.loss_spike_factor:g}; 0: off)")
    group.add_argument(
        "--divergence-loss-window", type=int, default=None, metavar="N",
        help=f"steps in the loss's running mean; the spike check starts once this many steps of "
             f"the run's start have been seen (default {d.loss_window})")


def divergence_problems(values: Mapping[str, object]) -> List[str]:
    """The guard's flags (`vars(namespace)`): ranges and combinations."""
    problems = []
    given = [k for k in _THRESHOLD_FLAGS if values.get(k) is not None]
    if not values["check_for_divergence"]:
        problems += [f"--{k.replace('_', '-')} has no effect with --no-check-for-divergence"
                     for k in given]
        return problems
    for key in ("divergence_loss_spike_factor", "divergence_weight_growth"):
        value = values.get(key)
        if value is not None and not (value == 0 or (math.isfinite(value) and value > 1)):
            problems.append(f"--{key.replace('_', '-')} {value:g}: must be above 1 (a factor), "
                            f"or 0 to turn this check off")
    steps = values.get("divergence_zero_grad_steps")
    if steps is not None and steps < 0:
        problems.append(f"--divergence-zero-grad-steps {steps}: must be a number of steps, or 0 "
                        f"to turn this check off")
    window = values.get("divergence_loss_window")
    if window is not None:
        if window < 1:
            problems.append(f"--divergence-loss-window {window}: must be at least 1 step")
        elif values.get("divergence_loss_spike_factor") == 0:
            problems.append("--divergence-loss-window has no effect with "
                            "--divergence-loss-spike-factor 0 (the spike check off)")
    return problems


def divergence_config(values: Mapping[str, object]) -> DivergenceConfig:
    """The guard's settings from validated flags (thresholds not given take the defaults)."""
    given = {field: values[key] for key, field in _THRESHOLD_FLAGS.items()
             if values.get(key) is not None}
    return DivergenceConfig(enabled=bool(values["check_for_divergence"]), **given)
