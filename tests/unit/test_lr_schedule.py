"""LRSchedule: every Megatron style against megatron-core's OptimizerParamScheduler, noam by
hand, validation, the flags, and resuming from a checkpoint under each policy."""

import argparse
import importlib.util
import sys
import types
from pathlib import Path
from unittest import mock

import pytest
import torch

from megatron.config.lr_schedule import (
    DECAY_STYLES,
    LRSchedule,
    from_args,
    resolve_with_checkpoint,
)

MAX_LR, MIN_LR = 3e-4, 1e-5


def megatron_core_scheduler_class():
    """megatron-core's OptimizerParamScheduler, loaded from its file: importing the megatron.core
    package takes ~5 s (it pulls in the transformer stack), and the scheduler needs only
    megatron.core.utils.log_single_rank, which a stand-in provides while the file loads."""
    package = importlib.util.find_spec("megatron.core")
    assert package is not None, "megatron-core is not installed"
    path = Path(list(package.submodule_search_locations)[0]) / "optimizer_param_scheduler.py"
    stub = types.ModuleType("megatron.core.utils")
    stub.log_single_rank = lambda logger, level, msg: logger.log(level, msg)
    spec = importlib.util.spec_from_file_location("_mcore_optimizer_param_scheduler", path)
    module = importlib.util.module_from_spec(spec)
    with mock.patch.dict(sys.modules, {"megatron.core.utils": stub}):
        spec.loader.exec_module(module)
    return module.OptimizerParamScheduler


def megatron_core_lrs(style, warmup, decay, steps):
    # The scheduler reads only optimizer.param_groups; a real torch optimizer would do as well
    # but its first construction imports torch._dynamo (~1.5 s).
    optimizer = types.SimpleNamespace(param_groups=[{"params": [], "lr": 0.0}])
    sched = megatron_core_scheduler_class()(
        optimizer, init_lr=0.0, max_lr=MAX_LR, min_lr=MIN_LR, lr_warmup_steps=warmup,
        lr_decay_steps=decay, lr_decay_style=style, start_wd=0.0, end_wd=0.0,
        wd_incr_steps=decay, wd_incr_style="constant")
    lrs = []
    for step in steps:
        sched.num_steps = step
        lrs.append(sched.get_lr(optimizer.param_groups[0]))
    return lrs


@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "inverse-square-root"])
@pytest.mark.parametrize("warmup,decay", [(0, 50), (10, 50), (1, 7), (49, 50)])
def test_matches_megatron_core(style, warmup, decay):
    steps = sorted({0, 1, 2, 5, warmup - 1, warmup, warmup + 1, (warmup + decay) // 2,
                    decay - 1, decay, decay + 1, 2 * decay, 10_000} - {-1})
    ours = LRSchedule(MAX_LR, MIN_LR, warmup, decay, style)
    theirs = megatron_core_lrs(style, warmup, decay, steps)
    for step, expected in zip(steps, theirs):
        assert ours.lr(step) == pytest.approx(expected, rel=1e-12, abs=0), (style, step)


def test_shape_landmarks():
    """Values a reader can check by eye, independently of megatron-core."""
    cosine = LRSchedule(1.0, 0.1, 10, 110, "cosine")
    assert [cosine.lr(s) for s in (0, 5, 10, 60, 110, 111)] == pytest.approx(
        [0.0, 0.5, 1.0, 0.55, 0.1, 0.1])
    linear = LRSchedule(1.0, 0.0, 0, 4, "linear")
    assert [linear.lr(s) for s in range(6)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0, 0.0])
    assert LRSchedule(1.0, 0.0, 4, 100, "inverse-square-root").lr(16) == pytest.approx(0.5)
    assert LRSchedule(1.0, 0.0, 4, 4, "constant").lr(10**6) == 1.0


def test_noam_by_hand():
    sched = LRSchedule(max_lr=1e-3, min_lr=1e-6, warmup_steps=100, decay_steps=10,
                       decay_style="noam")
    assert sched.lr(0) == 1e-6
    assert sched.lr(1) == pytest.approx(1e-3 * 10 * 1 * 100 ** -1.5)  # 1e-5: the ramp
    assert sched.lr(50) == pytest.approx(5e-4)
    assert sched.lr(100) == pytest.approx(1e-3)
    assert sched.lr(400) == pytest.approx(5e-4)  # 1e-3 * sqrt(100 / 400); past decay_steps
    assert sched.lr(10**12) == 1e-6  # 1e-3 * 1e-5 = 1e-8, floored at min_lr
    tiny_floor = LRSchedule(1e-3, 5e-5, 100, 10, "noam")
    assert tiny_floor.lr(1) == 5e-5  # the floor holds during the ramp too


@pytest.mark.parametrize("kwargs,flags", [
    (dict(max_lr=-1.0), ["--lr"]),
    (dict(max_lr=None), ["--lr"]),  # not a number: reported, not a TypeError from comparing
    (dict(warmup_steps="10"), ["--lr-warmup-iters"]),
    (dict(min_lr=float("nan")), ["--min-lr"]),
    (dict(warmup_steps=-1), ["--lr-warmup-iters"]),
    (dict(decay_steps=2.5), ["--lr-decay-iters"]),
    (dict(min_lr=1.0, max_lr=0.5), ["--min-lr", "--lr"]),
    (dict(warmup_steps=60, decay_steps=50), ["--lr-warmup-iters", "--lr-decay-iters"]),
    (dict(warmup_steps=0, decay_steps=0), ["--lr-decay-iters"]),
    (dict(decay_style="noam", warmup_steps=0), ["--lr-warmup-iters"]),
    (dict(decay_style="exponential"), ["--lr-decay-style", *DECAY_STYLES]),
])
def test_validation_names_the_flag(kwargs, flags):
    fields = dict(max_lr=1e-3, min_lr=0.0, warmup_steps=10, decay_steps=100, decay_style="linear")
    with pytest.raises(ValueError) as err:
        LRSchedule(**{**fields, **kwargs})
    for flag in flags:
        assert flag in str(err.value)


def test_validation_lists_every_problem():
    with pytest.raises(ValueError) as err:
        LRSchedule(max_lr=-1.0, min_lr=0.0, warmup_steps=-3, decay_steps=10, decay_style="step")
    assert all(f in str(err.value) for f in ("(--lr)", "--lr-warmup-iters", "--lr-decay-style"))


def test_warmup_beyond_decay_is_fine_where_decay_is_unused():
    assert LRSchedule(1.0, 0.0, 60, 50, "constant").lr(1000) == 1.0
    with pytest.raises(ValueError, match="step must be >= 0"):
        LRSchedule(1.0, 0.0, 6, 50, "constant").lr(-1)


def namespace(**overrides):
    args = dict(lr=1e-3, min_lr=1e-5, lr_decay_style="cosine", lr_decay_iters=None,
                lr_warmup_iters=None, lr_warmup_fraction=None)
    return argparse.Namespace(**{**args, **overrides})


def test_from_args_warmup():
    assert from_args(namespace(), train_iters=1000) == LRSchedule(1e-3, 1e-5, 0, 1000, "cosine")
    assert from_args(namespace(lr_warmup_iters=30), 1000).warmup_steps == 30
    # a fraction is of the decay steps (--lr-decay-iters when given), rounded: 0.29 * 100 is
    # 28.999999999999996 in floating point
    assert from_args(namespace(lr_warmup_fraction=0.01, lr_decay_iters=500), 1000) \
        == LRSchedule(1e-3, 1e-5, 5, 500, "cosine")
    assert from_args(namespace(lr_warmup_fraction=0.29), 100).warmup_steps == 29
    with pytest.raises(ValueError, match="--lr-warmup-iters or --lr-warmup-fraction, not both"):
        from_args(namespace(lr_warmup_iters=10, lr_warmup_fraction=0.01), 1000)
    with pytest.raises(ValueError, match="--lr-warmup-fraction must be in"):
        from_args(namespace(lr_warmup_fraction=1.5), 1000)
    with pytest.raises(ValueError, match="--lr-decay-iters or --train-iters"):
        from_args(namespace(), None)


def saved_through_torch(schedule, tmp_path):
    torch.save({"lr_schedule": schedule.state_dict()}, tmp_path / "ckpt.pt")
    return torch.load(tmp_path / "ckpt.pt", weights_only=True)["lr_schedule"]


def test_resolve_with_checkpoint(tmp_path):
    flags = LRSchedule(1e-3, 1e-5, 100, 1000, "cosine")
    other = LRSchedule(2e-3, 1e-5, 100, 2000, "linear")
    same = saved_through_torch(flags, tmp_path)
    assert {type(v) for v in flags.state_dict().values()} == {float, int, str}
    assert LRSchedule.from_state_dict(same) == flags
    assert resolve_with_checkpoint(flags, same) == flags
    saved = saved_through_torch(other, tmp_path)
    with pytest.raises(ValueError) as err:
        resolve_with_checkpoint(flags, saved, "check")
    message = str(err.value)
    assert "max_lr: flags 0.001 vs checkpoint 0.002" in message
    assert "decay_steps: flags 1000 vs checkpoint 2000" in message
    assert "decay_style: flags 'cosine' vs checkpoint 'linear'" in message
    assert "min_lr" not in message and "warmup_steps" not in message
    assert all(f in message for f in ("--use-new-lr", "--override-opt-param-scheduler",
                                      "--use-checkpoint-lr-scheduler"))
    assert resolve_with_checkpoint(flags, saved, "flags") == flags
    assert resolve_with_checkpoint(flags, saved, "checkpoint") == other
    with pytest.raises(ValueError, match="unknown policy"):
        resolve_with_checkpoint(flags, saved, "newest")
    with pytest.raises(ValueError, match=r"missing keys \['decay_style'\]"):
        resolve_with_checkpoint(flags, {k: v for k, v in saved.items() if k != "decay_style"})
