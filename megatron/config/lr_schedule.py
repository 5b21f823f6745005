"""The learning-rate schedule: a pure function of the number of optimizer steps done so far.

Megatron semantics (megatron-core's `OptimizerParamScheduler.get_lr` with init_lr = 0), for
`step` = optimizer steps done:

- warmup: if warmup_steps > 0 and step <= warmup_steps, lr = max_lr * step / warmup_steps
  (0 at step 0, max_lr at step == warmup_steps); every style but "noam" starts this way;
- "constant": max_lr after warmup; decay_steps is not used;
- past decay_steps (step > decay_steps): min_lr, for every other Megatron style;
- "inverse-square-root": max(min_lr, max_lr * sqrt(max(warmup_steps, 1)) / sqrt(max(step, 1)));
- "linear" / "cosine": from max_lr at warmup_steps down to min_lr at decay_steps.

"noam" (Vaswani et al.; CPM-2 offers it) brings its own warmup instead:
lr = max(min_lr, max_lr * sqrt(warmup_steps) * min(step**-0.5, step * warmup_steps**-1.5)) for
step >= 1, and min_lr at step 0. Up to warmup_steps that is the same linear ramp (but floored at
min_lr), at warmup_steps it is max_lr, and after it is the "inverse-square-root" curve, except
that it never falls to min_lr at decay_steps: noam does not use decay_steps.

The training loop calls `lr(step)` once per optimizer step; a checkpoint keeps `state_dict()`,
and on resume `resolve_with_checkpoint` decides whether the flags or the checkpoint win.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import List

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "noam")
POLICIES = ("check", "flags", "checkpoint")
# Field -> the flag that sets it, so that errors tell the user what to change.
FLAGS = {"max_lr": "--lr", "min_lr": "--min-lr", "warmup_steps": "--lr-warmup-iters",
         "decay_steps": "--lr-decay-iters", "decay_style": "--lr-decay-style"}


@dataclass(frozen=True)
class LRSchedule:
    """A learning-rate schedule (see the module docstring for the formulas).

    Raises ValueError on construction, listing every problem with the flag that sets it.
    """

    max_lr: float
    """Peak learning rate, reached at the end of warmup (--lr)."""
    min_lr: float
    """Floor of the decay, and the rate after decay_steps (--min-lr)."""
    warmup_steps: int
    """Optimizer steps of linear warmup from 0 (--lr-warmup-iters / --lr-warmup-fraction)."""
    decay_steps: int
    """Step at which linear / cosine decay reaches min_lr (--lr-decay-iters)."""
    decay_style: str
    """One of DECAY_STYLES (--lr-decay-style)."""

    def __post_init__(self) -> None:
        problems = self._problems()
        if problems:
            raise ValueError("invalid learning-rate schedule:\n  " + "\n  ".join(problems))

    def _problems(self) -> List[str]:
        problems = []
        for name in ("max_lr", "min_lr"):
            value = getattr(self, name)
            # `not value >= 0` also catches NaN.
            if not isinstance(value, numbers.Real) or not value >= 0:
                problems.append(f"{name} ({FLAGS[name]}) must be a number >= 0, got {value!r}")
        for name in ("warmup_steps", "decay_steps"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
                problems.append(f"{name} ({FLAGS[name]}) must be an integer >= 0, got {value!r}")
        numbers_ok = not problems  # the checks below compare the numbers
        if numbers_ok and self.min_lr > self.max_lr:
            problems.append(f"min_lr (--min-lr) {self.min_lr} exceeds max_lr (--lr) {self.max_lr}")
        if self.decay_style not in DECAY_STYLES:
            problems.append(f"decay_style (--lr-decay-style) {self.decay_style!r} is unknown; "
                            f"choose one of {', '.join(DECAY_STYLES)}")
        elif numbers_ok and self.decay_style in ("linear", "cosine"):
            if self.decay_steps == 0:
                problems.append(f"decay_steps (--lr-decay-iters) must be > 0 for "
                                f"{self.decay_style} decay")
            if self.warmup_steps > self.decay_steps:
                problems.append(f"warmup_steps (--lr-warmup-iters / --lr-warmup-fraction) "
                                f"{self.warmup_steps} exceeds decay_steps (--lr-decay-iters) "
                                f"{self.decay_steps} for {self.decay_style} decay")
        elif numbers_ok and self.decay_style == "noam" and self.warmup_steps == 0:
            problems.append("noam needs warmup_steps (--lr-warmup-iters / "
                            "--lr-warmup-fraction) > 0")
        return problems

    def lr(self, step: int) -> float:
        """The learning rate after `step` optimizer steps (step >= 0).

        Raises ValueError for a negative step.
        """
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if self.decay_style == "noam":
            return self._noam(step)
        if self.warmup_steps > 0 and step <= self.warmup_steps:
            return self.max_lr * step / self.warmup_steps
        if self.decay_style == "constant":
            return self.max_lr
        if step > self.decay_steps:
            return self.min_lr
        if self.decay_style == "inverse-square-root":
            scaled = self.max_lr * max(self.warmup_steps, 1) ** 0.5 / max(step, 1) ** 0.5
            return max(self.min_lr, scaled)
        ratio = (step - self.warmup_steps) / (self.decay_steps - self.warmup_steps)
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def _noam(self, step: int) -> float:
        if step == 0:  # the limit of the formula; step**-0.5 itself is undefined
            return self.min_lr
        w = self.warmup_steps
        return max(self.min_lr, self.max_lr * w ** 0.5 * min(step ** -0.5, step * w ** -1.5))

    def state_dict(self) -> dict:
        """The fields as plain Python numbers and strings (loadable with weights_only=True)."""
        return {"max_lr": float(self.max_lr), "min_lr": float(self.min_lr),
                "warmup_steps": int(self.warmup_steps), "decay_steps": int(self.decay_steps),
                "decay_style": str(self.decay_style)}

    @classmethod
    def from_state_dict(cls, saved: dict) -> "LRSchedule":
        """The schedule that `state_dict()` describes.

        Raises ValueError if keys are missing or unknown, or the values are invalid.
        """
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [n for n in names if n not in saved]
        unknown = sorted(set(saved) - set(names))
        if missing or unknown:
            raise ValueError(f"learning-rate schedule state: missing keys {missing}, "
                             f"unknown keys {unknown}")
        return cls(**{n: saved[n] for n in names})


def from_args(args: argparse.Namespace, train_iters: int) -> LRSchedule:
    """The schedule that Megatron-style flags ask for.

    Reads args.lr, args.min_lr, args.lr_decay_style, args.lr_decay_iters (None: train_iters),
    args.lr_warmup_iters and args.lr_warmup_fraction (both default None; a fraction is of the
    decay steps, rounded to the nearest step; CPM-2's `--warmup 0.01` is a fraction). The
    parser must default both warmup flags to None, since giving both is an error.

    Raises ValueError if both warmup flags are given, the fraction is outside [0, 1], no decay
    length is known, or the resulting schedule is invalid.
    """
    if args.lr is None:
        raise ValueError("--lr is required")
    decay_steps = args.lr_decay_iters if args.lr_decay_iters is not None else train_iters
    if decay_steps is None:
        raise ValueError("give --lr-decay-iters or --train-iters")
    warmup_iters = getattr(args, "lr_warmup_iters", None)
    fraction = getattr(args, "lr_warmup_fraction", None)
    if warmup_iters is not None and fraction is not None:
        raise ValueError("give --lr-warmup-iters or --lr-warmup-fraction, not both")
    if fraction is not None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"--lr-warmup-fraction must be in [0, 1], got {fraction}")
        warmup_iters = round(fraction * decay_steps)
    return LRSchedule(max_lr=args.lr, min_lr=args.min_lr, warmup_steps=warmup_iters or 0,
                      decay_steps=decay_steps, decay_style=args.lr_decay_style)


def resolve_with_checkpoint(flags: LRSchedule, saved: dict, policy: str = "check") -> LRSchedule:
    """The schedule to resume with, given the flags' and the checkpoint's (`saved`).

    policy "check": they must be equal; "flags": take the flags' (--use-new-lr /
    --override-opt-param-scheduler); "checkpoint": take the checkpoint's
    (--use-checkpoint-lr-scheduler).

    Raises ValueError for an unknown policy, an unreadable `saved`, or (policy "check") any
    difference, listing each field as `name: flags X vs checkpoint Y`.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    if policy == "flags":
        return flags
    checkpoint = LRSchedule.from_state_dict(saved)
    if policy == "checkpoint":
        return checkpoint
    diffs = [f"{f.name}: flags {getattr(flags, f.name)!r} vs checkpoint "
             f"{getattr(checkpoint, f.name)!r}" for f in dataclasses.fields(LRSchedule)
             if getattr(flags, f.name) != getattr(checkpoint, f.name)]
    if diffs:
        raise ValueError("the learning-rate schedule in the checkpoint differs from the flags:\n  "
                         + "\n  ".join(diffs) + "\npass --use-new-lr (or "
                         "--override-opt-param-scheduler) to take the flags, or "
                         "--use-checkpoint-lr-scheduler to take the checkpoint's")
    return flags
