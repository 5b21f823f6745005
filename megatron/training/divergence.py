"""The divergence guard: stop a run whose loss and gradient norm are finite but that has diverged.

The NaN guard (loop.py) stops at the first non-finite loss or gradient norm. A learning rate far
too high can first leave a model that is finite and dead: its weights multiplied by thousands,
its logits all equal (the loss stuck at ln(vocabulary)), its gradient norm exactly 0; such a
model would be saved, step after step, until something overflows. Three checks, each with its
own threshold (megatron/config/training.py, DivergenceConfig, says why the defaults never
fire on healthy runs; `--check-for-divergence` turns them all off):

- **weight growth**: the norm of a weight tensor (a rank's part of it: its tensor shard, its
  ZeRO-3 partition; tensors under 1024 elements pooled into one) grew by more than
  `--divergence-weight-growth` in one step. Read right after the update, so it fires at the step
  whose update blew up, before that step could be saved.
- **zero gradient norm**: `--divergence-zero-grad-steps` consecutive steps whose global gradient
  norm was exactly 0 (fp16 steps that overflowed and were skipped are not counted, nor do they
  break a run of zeros).
- **loss spike**: a step's loss is more than `--divergence-loss-spike-factor` times the mean of
  the previous `--divergence-loss-window` steps' losses (checked once the window is full).

A step's loss and gradient norm are taken on the weights the step before left, so those two
checks judge the previous step's weights. The loop therefore holds each interval save uncommitted
(written, but the tracker not moved: saver.py) until the next step has passed them, and for as
long as a run of zero norms is under way; a stop by those checks (or by the NaN guard) removes
what is held, a stop by the weight growth alone first commits it (this step's loss and norm
passed it). Whatever fires, the tracker names the last checkpoint whose weights passed every
check. The final save (the last step, an exit condition, a signal) is committed at once: no step
would come to judge it.

Every rank takes the same decision: each rank's values (its step loss, the gradient norm, whether
the step was skipped, its weight growth and weight norm) join the all-reduce (MAX) that already
agrees on stopping, and every rank then runs the same checks on the same agreed numbers. The loss
is therefore the highest data-parallel rank's step loss (with a pipeline every stage has it: the
step sums it over the stages). Nothing else is communicated.

Megatron-LM's `--check-for-spiky-loss` (pretrain_gpt.py's loss function and megatron-core's
rerun_state_machine.py, `is_unexpectedly_large`) compares each micro-batch's summed loss on each
rank, before the data-parallel reduction, with 10x the largest of the first 100 it saw (that
reference is then fixed); with `--rerun-mode validate_results` a hit re-runs the step to tell a
hardware fault from a real spike. Either way it only logs (fatal=False): the run goes on and
keeps saving. Its `check_for_large_grads` does the same with each gradient bucket's norm. Here
the reference is a running mean (it follows the loss down as the model learns), a hit stops the
run before the judged weights are committed, and the two checks Megatron has no counterpart for
catch the finite blow-up that a spike check misses (the loss falls to ln(vocabulary) rather
than rising).
"""

from __future__ import annotations

import math
from collections import deque
from typing import List, Mapping, NamedTuple, Optional

import torch

from megatron.failures import RunFailure
from megatron.config.training import DivergenceConfig
from megatron.training.step_metrics import MAX, Metrics, metric



class DivergenceError(RunFailure):
    """The divergence guard stopped the run (the message says at which iteration, which check,
    what it saw and which checkpoint the tracker names); raised on every rank, before anything
    of the diverged steps is committed."""


class Divergence(NamedTuple):
    check: str
    """'weight growth', 'zero gradient norm' or 'loss spike'."""
    seen: str
    """What was seen, in words with the values."""
    flag: str
    """The threshold's flag and value."""
    saves_before_passed: bool = False
    """The weight growth judged this step's update while the checks that judge the weights
    before it (this step's loss and gradient norm) passed: the held saves may be committed."""


class StepSigns(NamedTuple):
    """One step as every rank agreed on it (the stop all-reduce's MAX)."""

    loss: Optional[float]
    """The highest rank's step loss (None: not finite anywhere)."""
    grad_norm: Optional[float]
    """The global gradient norm (None: not reported, or not finite)."""
    skipped: bool
    """Some rank's update was skipped (fp16 overflow)."""
    weight_growth: Optional[float]
    """The largest factor by which a weight tensor's norm grew in the step (None: not
    known)."""
    weight_norm: Optional[float]
    """The largest weight-tensor norm after the step (None: not known)."""


# The checks -------------------------------------------------------------------------------------
class DivergenceGuard:
    """The checks over the steps of one start, fed with the agreed `StepSigns` of each step (the
    same on every rank, so every rank's guard takes the same decisions)."""

    def __init__(self, config: DivergenceConfig) -> None:
        self.config = config
        self._losses: deque = deque(maxlen=max(config.loss_window, 1))
        self._zeros: List[int] = []  # the iterations of the run of zero norms under way

    @property
    def unsure(self) -> bool:
        """The last step began a run of zero gradient norms that is not yet long enough to
        stop: the saves made before it stay held until the run ends either way."""
        return bool(self._zeros)

    def observe(self, iteration: int, signs: StepSigns) -> Optional[Divergence]:
        """The check that fires at `iteration` (None: none). The zero norm and the spike, which
        judge the weights the step before left, come first; the weight growth, which judges
        this step's update, last (its finding says whether the others passed)."""
        c = self.config
        if not c.enabled:
            return None
        found = self._zero_norm(iteration, signs) or self._spike(signs)
        if found is not None:
            return found
        if c.weight_growth > 0 and signs.weight_growth is not None \
                and signs.weight_growth > c.weight_growth:
            norm = f"; the largest is now {signs.weight_norm:.4g}" \
                if signs.weight_norm is not None else ""
            return Divergence("weight growth",
                              f"the norm of a weight tensor grew {signs.weight_growth:.4g} "
                              f"times in one step{norm}",
                              f"--divergence-weight-growth {c.weight_growth:g}",
                              saves_before_passed=not self.unsure)
        return None

    def _zero_norm(self, iteration: int, signs: StepSigns) -> Optional[Divergence]:
        c = self.config
        if c.zero_grad_steps <= 0 or signs.skipped or signs.grad_norm is None:
            return None
        if signs.grad_norm != 0.0:
            self._zeros = []
            return None
        self._zeros.append(iteration)
        if len(self._zeros) < c.zero_grad_steps:
            return None
        steps = self._zeros
        span = f"iteration {steps[0]}" if len(steps) == 1 else \
            f"{len(steps)} steps in a row (iterations {steps[0]} to {steps[-1]})"
        loss = f"; the loss {signs.loss:.6g}" if signs.loss is not None else ""
        return Divergence("zero gradient norm",
                          f"the gradient norm was exactly 0 at {span}{loss}",
                          f"--divergence-zero-grad-steps {c.zero_grad_steps}")

    def _spike(self, signs: StepSigns) -> Optional[Divergence]:
        c = self.config
        if c.loss_spike_factor <= 0 or signs.loss is None:
            return None
        if len(self._losses) == self._losses.maxlen:
            mean = sum(self._losses) / len(self._losses)
            if signs.loss > c.loss_spike_factor * mean:
                return Divergence("loss spike",
                                  f"the loss {signs.loss:.4g} is {signs.loss / mean:.3g} times "
                                  f"the mean of the previous {len(self._losses)} steps "
                                  f"({mean:.4g})",
                                  f"--divergence-loss-spike-factor {c.loss_spike_factor:g}")
        self._losses.append(signs.loss)
        return None


# The numbers each rank adds to the stop all-reduce ----------------------------------------------
class WeightGrowth:
    """How much the weights of this rank grew in a step, on the device (no host
    synchronisation): `start()` before the first step, `update()` after each. The growth is the
    largest ratio, new norm over old, of a weight tensor this rank holds (the step's
    `weight_norms`: small tensors pooled), so that a blow-up of the attention and MLP matrices
    is not hidden behind a large embedding that moves little.

    step: the TrainStep; where its `weight_norms()` is None the check is off on this rank (the
    others still count)."""

    def __init__(self, step) -> None:
        self.step = step
        self._previous: Optional[torch.Tensor] = None

    def start(self) -> None:
        self._previous = self.step.weight_norms()

    def update(self):
        """(growth factor, the largest tensor norm) of this step as float64 device scalars, or
        None."""
        now = self.step.weight_norms()
        previous, self._previous = self._previous, now
        if now is None or previous is None or now.shape != previous.shape:
            return None
        usable = torch.isfinite(previous) & (previous > 0)  # a tensor started at 0: no ratio
        ratios = torch.where(usable, now / previous.clamp(min=1e-300), torch.ones_like(now))
        # weights that overflowed grew without bound (and a NaN would spoil the MAX)
        ratios = torch.nan_to_num(ratios, nan=math.inf, posinf=math.inf)
        return ratios.max(), torch.nan_to_num(now, nan=math.inf, posinf=math.inf).max()


SIGN_NAMES = ("loss", "grad_norm", "skipped", "weight_growth", "weight_norm")
"""The guard's MAX step metrics, 'divergence/<name>' (see `step_metrics`)."""


def step_metrics(result, weights, device) -> Metrics:
    """This rank's numbers for the stop all-reduce (MAX step metrics 'divergence/...'), on the
    device: its step loss, the gradient norm, skipped, weight growth, weight norm; -1 (loss,
    norm) and 0 (growth) stand for 'not known', so that the MAX over ranks is the largest known
    value.

    result: the step's StepResult; weights: WeightGrowth.update()'s value (or None)."""
    loss = result.loss.to(device=device, dtype=torch.float64)
    norm = result.grad_norm
    growth, weight_norm = weights if weights is not None else (0.0, 0.0)
    values = {"loss": torch.where(torch.isfinite(loss), loss, torch.full_like(loss, -1.0)),
              "grad_norm": norm if norm is not None and math.isfinite(norm) else -1.0,
              "skipped": float(bool(result.skipped)),
              "weight_growth": growth, "weight_norm": weight_norm}
    return {f"divergence/{name}": metric(value, MAX, device) for name, value in values.items()}


def agreed_signs(values: Mapping[str, torch.Tensor]) -> StepSigns:
    """The StepSigns from the reduced 'divergence/...' metrics."""
    loss, norm, skipped, growth, weight_norm = (float(values[f"divergence/{name}"])
                                                for name in SIGN_NAMES)
    return StepSigns(loss if loss >= 0 else None, norm if norm >= 0 else None, skipped > 0,
                     growth if growth > 0 else None, weight_norm if growth > 0 else None)
