"""The divergence guard (megatron/training/divergence.py) against hand-computed sequences: each
check fires exactly where the arithmetic says and not a step before; the flags are validated; the
weight norms and growth are those computed by hand."""

import math

import pytest
import torch

from megatron.arguments import build_parser
from megatron.config.divergence_args import divergence_config, divergence_problems
from megatron.training.divergence import (SIGN_NAMES, DivergenceGuard, StepSigns,
                                          WeightGrowth, agreed_signs, step_metrics)
from megatron.config.training import DivergenceConfig
from megatron.training.step import SMALL_TENSOR, StepResult, core_metrics, weight_norms


def signs(loss=5.0, grad_norm=1.0, skipped=False, growth=1.0, norm=10.0):
    return StepSigns(loss, grad_norm, skipped, growth, norm)


def run(guard, steps):
    """Feed the steps (iterations 1, 2, ...); the iteration and finding of the first firing."""
    for iteration, step in enumerate(steps, start=1):
        found = guard.observe(iteration, step)
        if found is not None:
            return iteration, found
    return None, None


ONLY_SPIKE = dict(zero_grad_steps=0, weight_growth=0.0)
ONLY_ZERO = dict(loss_spike_factor=0.0, weight_growth=0.0)
ONLY_GROWTH = dict(loss_spike_factor=0.0, zero_grad_steps=0)


# The loss spike ---------------------------------------------------------------------------------
def test_a_spike_above_factor_times_the_running_mean_fires():
    # window 3, factor 2: after 6, 4, 2 the mean is 4, so 8 is allowed and 8.01 is not; then the
    # window holds 4, 2, 8 (mean 14/3) and the limit is 28/3 = 9.333...
    for last, fires in ((9.33, False), (9.34, True)):
        guard = DivergenceGuard(DivergenceConfig(loss_spike_factor=2.0, loss_window=3,
                                                 **ONLY_SPIKE))
        iteration, found = run(guard, [signs(loss=v) for v in [6.0, 4.0, 2.0, 8.0, last]])
        assert (iteration, found and found.check) == ((5, "loss spike") if fires else
                                                      (None, None))
    guard = DivergenceGuard(DivergenceConfig(loss_spike_factor=2.0, loss_window=3, **ONLY_SPIKE))
    iteration, found = run(guard, [signs(loss=v) for v in [6.0, 4.0, 2.0, 8.01]])
    assert iteration == 4
    assert found.seen == "the loss 8.01 is 2 times the mean of the previous 3 steps (4)"
    assert found.flag == "--divergence-loss-spike-factor 2"


def test_no_spike_check_before_the_window_is_full():
    guard = DivergenceGuard(DivergenceConfig(loss_spike_factor=2.0, loss_window=3, **ONLY_SPIKE))
    assert run(guard, [signs(loss=v) for v in [1.0, 100.0, 1000.0]]) == (None, None)
    assert guard.observe(4, signs(loss=10000.0)) is not None  # 10000 > 2 * 367


def test_non_finite_losses_are_left_to_the_nan_guard():
    guard = DivergenceGuard(DivergenceConfig(loss_spike_factor=2.0, loss_window=1, **ONLY_SPIKE))
    assert run(guard, [signs(loss=1.0), signs(loss=None), signs(loss=1.9)]) == (None, None)


# The zero gradient norm -------------------------------------------------------------------------
def test_consecutive_zero_norms_fire_at_the_nth():
    guard = DivergenceGuard(DivergenceConfig(zero_grad_steps=3, **ONLY_ZERO))
    norms = [1.0, 0.0, 0.0, 0.5, 0.0, 0.0, 0.0]
    iteration, found = run(guard, [signs(grad_norm=v, loss=8.3187) for v in norms])
    assert iteration == 7 and found.check == "zero gradient norm"
    assert found.seen == ("the gradient norm was exactly 0 at 3 steps in a row (iterations 5 to "
                          "7); the loss 8.3187")


def test_the_guard_is_unsure_while_a_run_of_zeros_is_under_way():
    guard = DivergenceGuard(DivergenceConfig(zero_grad_steps=2, **ONLY_ZERO))
    assert guard.observe(1, signs(grad_norm=0.0)) is None and guard.unsure
    assert guard.observe(2, signs(grad_norm=1e-12)) is None and not guard.unsure
    assert guard.observe(3, signs(grad_norm=0.0)) is None and guard.unsure
    assert guard.observe(4, signs(grad_norm=0.0)).check == "zero gradient norm"


def test_skipped_and_unknown_norms_neither_count_nor_break_a_run():
    # fp16 overflow: DeepSpeed reports inf (here: not finite, so None) and skips the update
    guard = DivergenceGuard(DivergenceConfig(zero_grad_steps=2, **ONLY_ZERO))
    steps = [signs(grad_norm=0.0), signs(grad_norm=0.0, skipped=True), signs(grad_norm=None),
             signs(grad_norm=0.0)]
    iteration, found = run(guard, steps)
    assert iteration == 4 and "(iterations 1 to 4)" in found.seen
    guard = DivergenceGuard(DivergenceConfig(zero_grad_steps=1, **ONLY_ZERO))
    assert run(guard, [signs(grad_norm=0.0, skipped=True)] * 5) == (None, None)


# The weight growth ------------------------------------------------------------------------------
def test_weight_growth_above_the_factor_fires():
    guard = DivergenceGuard(DivergenceConfig(weight_growth=2.0, **ONLY_GROWTH))
    growths = [1.0, 1.01, 2.0, 1.5, 2.0001]
    iteration, found = run(guard, [signs(growth=g, norm=123.0) for g in growths])
    assert iteration == 5 and found.check == "weight growth"
    assert found.seen == "the norm of a weight tensor grew 2 times in one step; the largest is " \
                         "now 123"
    assert found.flag == "--divergence-weight-growth 2"
    assert found.saves_before_passed  # the loss and norm of step 5 passed step 4's weights
    # a zero norm at the step: the weights before it are not cleared
    guard = DivergenceGuard(DivergenceConfig(weight_growth=2.0, zero_grad_steps=2,
                                             loss_spike_factor=0))
    found = guard.observe(1, signs(grad_norm=0.0, growth=3.0))
    assert found.check == "weight growth" and not found.saves_before_passed


def test_the_checks_come_in_order_and_off_means_off():
    # the checks that judge the weights before the step first, then the step's own update
    both = signs(loss=100.0, grad_norm=0.0, growth=10.0)
    guard = DivergenceGuard(DivergenceConfig(loss_window=1, zero_grad_steps=1))
    found = guard.observe(1, both)
    assert found.check == "zero gradient norm" and not found.saves_before_passed
    guard = DivergenceGuard(DivergenceConfig(loss_window=1))
    assert guard.observe(1, signs(loss=1.0)) is None
    found = guard.observe(2, both)
    assert found.check == "loss spike" and not found.saves_before_passed
    off = DivergenceGuard(DivergenceConfig(enabled=False, loss_window=1, zero_grad_steps=1))
    assert run(off, [signs(loss=1.0), both, both]) == (None, None)
    zeros = DivergenceGuard(DivergenceConfig(loss_spike_factor=0, zero_grad_steps=0,
                                             weight_growth=0))
    assert run(zeros, [signs(loss=1.0)] * 200 + [both] * 3) == (None, None)
    assert not zeros.config.judges_next_step
    assert DivergenceConfig(**ONLY_GROWTH).judges_next_step is False
    assert DivergenceConfig(**ONLY_ZERO).judges_next_step is True


class FakeStep:
    def __init__(self, norms):
        self.norms = iter(norms)

    def weight_norms(self):
        value = next(self.norms)
        return None if value is None else torch.tensor(value, dtype=torch.float64)


def test_weight_growth_is_the_largest_tensor_ratio():
    # tensor 1: 5 -> 5 -> 15 (3x), tensor 2: 2 -> 3 (1.5x) -> 3; a tensor at 0 has no ratio
    weights = WeightGrowth(FakeStep([[5.0, 2.0, 0.0], [5.0, 3.0, 4.0], [15.0, 3.0, 40.0]]))
    weights.start()
    growth, norm = weights.update()
    assert growth.item() == pytest.approx(1.5) and norm.item() == 5.0
    growth, norm = weights.update()
    assert growth.item() == pytest.approx(10.0) and norm.item() == 40.0
    overflowed = WeightGrowth(FakeStep([[1.0], [math.inf]]))
    overflowed.start()
    assert overflowed.update()[0].item() == math.inf
    unknown = WeightGrowth(FakeStep([None, [1.0]]))
    unknown.start()
    assert unknown.update() is None


def test_weight_norms_by_hand():
    big16 = torch.full((SMALL_TENSOR,), 3000.0, dtype=torch.float16)  # norm 96000 > 65504
    big32 = torch.full((2 * SMALL_TENSOR,), -0.5)
    small = [torch.tensor([3.0, 4.0]), torch.tensor([12.0], dtype=torch.bfloat16)]
    norms = weight_norms([small[0], big16, torch.empty(0), big32, small[1]], torch.device("cpu"))
    assert norms.dtype == torch.float64
    assert norms.tolist() == pytest.approx([3000.0 * 32, 0.5 * 2048 ** 0.5, 13.0], rel=1e-6)
    assert weight_norms([], torch.device("cpu")) is None


def test_local_and_agreed_signs():
    def local(result, weights):
        metrics = step_metrics(result, weights, "cpu")
        assert all(m.reduce == "max" for m in metrics.values())
        values = {name: m.value for name, m in metrics.items()}
        return values, [float(values[f"divergence/{n}"]) for n in SIGN_NAMES]

    result = StepResult(core_metrics(torch.tensor(2.5, dtype=torch.float64), 1, 1), 0.0, False,
                        1.0)
    values, row = local(result, (torch.tensor(1.5, dtype=torch.float64),
                                 torch.tensor(7.0, dtype=torch.float64)))
    assert row == [2.5, 0.0, 0.0, 1.5, 7.0]
    assert agreed_signs(values) == StepSigns(2.5, 0.0, False, 1.5, 7.0)
    nan = StepResult(core_metrics(torch.tensor(math.nan, dtype=torch.float64), 1, 1), None,
                     True, 1.0)
    values, row = local(nan, None)
    assert row == [-1.0, -1.0, 1.0, 0.0, 0.0]
    assert agreed_signs(values) == StepSigns(None, None, True, None, None)


# Flags ------------------------------------------------------------------------------------------
def values(*argv):
    return vars(build_parser().parse_args(list(argv)))


def test_defaults_and_thresholds_from_the_flags():
    assert divergence_config(values()) == DivergenceConfig()
    assert DivergenceConfig().enabled and DivergenceConfig().judges_next_step
    given = divergence_config(values("--divergence-weight-growth", "10",
                                     "--divergence-zero-grad-steps", "0",
                                     "--divergence-loss-spike-factor", "4",
                                     "--divergence-loss-window", "20"))
    assert given == DivergenceConfig(True, 4.0, 20, 0, 10.0)
    assert not divergence_config(values("--no-check-for-divergence")).enabled
    assert divergence_problems(values()) == []
    assert divergence_problems(values("--divergence-weight-growth", "0")) == []


@pytest.mark.parametrize("argv,problem", [
    (["--divergence-weight-growth", "1"], "--divergence-weight-growth 1: must be above 1 (a "
                                          "factor), or 0 to turn this check off"),
    (["--divergence-loss-spike-factor", "-2"], "--divergence-loss-spike-factor -2: must be "
                                               "above 1"),
    (["--divergence-loss-spike-factor", "inf"], "--divergence-loss-spike-factor inf: must be"),
    (["--divergence-zero-grad-steps", "-1"], "--divergence-zero-grad-steps -1: must be a number"),
    (["--divergence-loss-window", "0"], "--divergence-loss-window 0: must be at least 1 step"),
    (["--divergence-loss-window", "5", "--divergence-loss-spike-factor", "0"],
     "--divergence-loss-window has no effect with --divergence-loss-spike-factor 0"),
    (["--no-check-for-divergence", "--divergence-zero-grad-steps", "3"],
     "--divergence-zero-grad-steps has no effect with --no-check-for-divergence"),
])
def test_bad_flags_are_named(argv, problem):
    problems = divergence_problems(values(*argv))
    assert len(problems) == 1 and problems[0].startswith(problem), problems
