"""The training loop: steps, evaluation, logging, checkpoints and the exit conditions.

One step is one optimizer update over the global batch: each rank runs
`gradient_accumulation_steps` micro-batches, calling `engine.backward` and `engine.step` after
each (DeepSpeed updates at the accumulation boundary). Step k uses `schedule.lr(k)`, as
Megatron's scheduler does. Losses stay on the device until a log boundary, where one
all-reduce over the data-parallel group turns them into the global per-step losses (the loss of
a step is the mean of its micro-batch losses, which is what the gradient is the mean of).

Evaluation runs over the same first `eval_iters` global batches of the split each time, so the
numbers are comparable across evaluations and across a resume; its loss is the token-weighted
mean over all ranks.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional

import torch
import torch.distributed as dist

from megatron import parallel_state
from megatron.model.flops import training_step_flops
from megatron.training.engine import set_lr
from megatron.training.metrics import IntervalStats, MetricsWriter, Timer, peak_tflops
from megatron.training.watchdog import NoWatchdog

BATCH_KEYS = ("encoder_input_ids", "decoder_input_ids", "encoder_attention_mask",
              "decoder_attention_mask", "labels")


@dataclass
class TrainState:
    iteration: int = 0
    consumed_samples: int = 0
    losses: Dict[int, float] = field(default_factory=dict)
    """iteration -> global loss of that step (filled at log boundaries)."""
    grad_norms: Dict[int, Optional[float]] = field(default_factory=dict)
    """iteration -> global gradient norm before clipping."""
    evaluations: List[tuple] = field(default_factory=list)
    """(iteration, split, loss)."""
    exit_reason: str = ""


def to_device(batch: Dict[str, torch.Tensor], device: torch.device) -> Dict[str, torch.Tensor]:
    return {k: batch[k].to(device, non_blocking=True) for k in BATCH_KEYS}


def _device(args) -> torch.device:
    if args.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _loss_scale(engine) -> float:
    scale = getattr(engine.optimizer, "cur_scale", None)
    if scale is None:
        scale = getattr(getattr(engine.optimizer, "loss_scaler", None), "cur_scale", None)
    return float(scale) if scale is not None else 1.0


def _unreported_grad_norm(engine) -> Optional[float]:
    """The clipping norm where DeepSpeed computes it without keeping it (ZeRO-0 in fp32): taken
    over the reduced gradients before the step clips them (tensor shards counted once)."""
    if engine.zero_optimization_stage() != 0 or engine.bfloat16_enabled() \
            or engine.fp16_enabled():
        return None
    from deepspeed.runtime.utils import clip_grad_norm_

    return float(clip_grad_norm_(list(engine.module.parameters()), max_norm=float("inf"),
                                 mpu=parallel_state))


def _grad_norm(engine) -> Optional[float]:
    norm = engine.get_global_grad_norm()
    if norm is None:
        return None
    return float(norm.item() if torch.is_tensor(norm) else norm)


def evaluate(engine, args: argparse.Namespace, loader: Optional[Iterable],
             watchdog=None) -> Optional[float]:
    """Token-weighted mean loss over `eval_iters` global batches of `loader` (all ranks)."""
    if loader is None or args.eval_iters == 0:
        return None
    watchdog = watchdog or NoWatchdog()
    collective_s, data_s = 60 * args.distributed_timeout_minutes, 60 * args.data_timeout_minutes
    device = _device(args)
    total = torch.zeros(2, dtype=torch.float64, device=device)  # [loss sum, tokens]
    limit = args.eval_iters * args.gradient_accumulation_steps
    batches = iter(loader)
    engine.eval()
    with torch.no_grad():
        for _ in range(limit):
            with watchdog.watch("data: the next evaluation batch from the data loader", data_s):
                batch = next(batches, None)
            if batch is None:
                break
            with watchdog.watch("an evaluation step (collectives with the other ranks)",
                                collective_s):
                batch = to_device(batch, device)
                out = engine(**batch)
                total[0] += out.token_losses.double().sum()
                total[1] += (batch["labels"] != -100).sum()
    engine.train()
    with watchdog.watch("collective: the all-reduce of the evaluation loss", collective_s):
        dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
    return float(total[0] / total[1]) if total[1] > 0 else None


def train(args: argparse.Namespace, engine, schedule, train_loader: Iterable, valid_loader,
          writer: MetricsWriter, state: TrainState, save: Callable[[TrainState], None],
          signals=None, watchdog=None) -> TrainState:
    """Run steps from state.iteration to args.train_iters (or an exit condition)."""
    watchdog = watchdog or NoWatchdog()
    collective_s = 60 * args.distributed_timeout_minutes
    data_s = 60 * args.data_timeout_minutes
    device = _device(args)
    gas = args.gradient_accumulation_steps
    model = engine.module
    flops = training_step_flops(args.model, args.global_batch_size, args.encoder_seq_length,
                                args.decoder_seq_length, model.padded_vocab_size).model
    device_name = torch.cuda.get_device_name() if args.device_type == "cuda" else "cpu"
    peak = peak_tflops(device_name, args.precision, args.peak_tflops)
    dp_group = parallel_state.get_data_parallel_group()
    stats, timer = IntervalStats(), Timer()
    pending: List[tuple] = []  # (iteration, [loss, input tokens, target tokens], norm, skipped)
    start_time = time.monotonic()
    batches = iter(train_loader)

    def flush_logs():
        if not pending:
            return
        values = torch.stack([p[1] for p in pending])
        with watchdog.watch("collective: the all-reduce of the step losses", collective_s):
            dist.all_reduce(values, group=dp_group)
        dp = parallel_state.get_data_parallel_world_size()
        for (iteration, _, norm, skipped, step_s, wait_s), row in zip(pending, values.tolist()):
            loss = row[0] / (dp * gas)
            state.losses[iteration] = loss
            state.grad_norms[iteration] = norm
            stats.add_step(loss_sum=loss, loss_count=1, grad_norm=norm, skipped=skipped,
                           input_tokens=int(row[1]), target_tokens=int(row[2]),
                           model_flops=flops, step_time_s=step_s, data_wait_s=wait_s)
        pending.clear()

    timer.reset()
    while state.iteration < args.train_iters:
        set_lr(engine.optimizer, schedule.lr(state.iteration))
        step = torch.zeros(3, dtype=torch.float64, device=device)
        skipped_before = engine.skipped_steps
        norm = None
        for micro in range(gas):
            timer.data_start()
            with watchdog.watch("data: the next training batch from the data loader", data_s):
                batch = next(batches)
            timer.data_end()
            with watchdog.watch("the training step (forward, backward, optimizer; collectives "
                                "with the other ranks)", collective_s):
                batch = to_device(batch, device)
                out = engine(**batch)
                engine.backward(out.loss)
                if micro == gas - 1:
                    norm = _unreported_grad_norm(engine)
                engine.step()
            step[0] += out.loss.detach().double()
            step[1] += batch["encoder_attention_mask"].sum()
            step[2] += (batch["labels"] != -100).sum()
        state.iteration += 1
        state.consumed_samples += args.global_batch_size
        norm = _grad_norm(engine) if norm is None else norm
        step_s, wait_s = timer.step_end()
        pending.append((state.iteration, step, norm, engine.skipped_steps > skipped_before,
                        step_s, wait_s))

        last = state.iteration == args.train_iters
        if state.iteration % args.log_interval == 0 or last:
            flush_logs()
            writer.write(stats.summary(state.iteration, state.consumed_samples,
                                       schedule.lr(state.iteration - 1), _loss_scale(engine),
                                       dist.get_world_size(), peak))
        if args.eval_interval and state.iteration % args.eval_interval == 0 and not last:
            loss = evaluate(engine, args, valid_loader, watchdog)
            if loss is not None:
                state.evaluations.append((state.iteration, "valid", loss))
                writer.write_eval(state.iteration, "valid", loss)
            timer.reset()
        with watchdog.watch("collective: the all-reduce that agrees on stopping",
                            collective_s):
            exit_now = _exit_requested(args, state, start_time, device, signals)
        saved = False
        if args.save and (last or exit_now or (args.save_interval and
                                               state.iteration % args.save_interval == 0)):
            flush_logs()
            with watchdog.watch(f"checkpoint I/O: saving iteration {state.iteration} to "
                                f"{args.save}", 60 * args.checkpoint_timeout_minutes):
                save(state)
            saved = True
            timer.reset()
        if exit_now:
            flush_logs()
            writer.write_text(f" exiting at iteration {state.iteration}: {state.exit_reason}"
                              + (" (checkpoint saved)" if saved else ""))
            break
    flush_logs()
    return state


def _exit_requested(args, state: TrainState, start_time: float, device, signals) -> bool:
    """Whether to stop after this step: --exit-interval, or (agreed by all ranks through one
    all-reduce, so that they save and leave together) --exit-duration-in-mins or a stop
    signal received by any rank."""
    if state.iteration >= args.train_iters:
        return False
    if args.exit_interval and state.iteration % args.exit_interval == 0:
        state.exit_reason = f"--exit-interval {args.exit_interval}"
        return True
    timed_out = args.exit_duration_in_mins is not None and \
        time.monotonic() - start_time > args.exit_duration_in_mins * 60
    signum = signals.received if signals is not None and signals.received is not None else 0
    flags = torch.tensor([float(timed_out), float(signum)], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    if flags[1].item() > 0:
        import signal

        state.exit_reason = f"signal {signal.Signals(int(flags[1].item())).name}"
        return True
    if flags[0].item() > 0:
        state.exit_reason = f"--exit-duration-in-mins {args.exit_duration_in_mins}"
        return True
    return False


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 20.0))
