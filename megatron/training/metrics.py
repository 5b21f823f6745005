"""What the training loop logs every --log-interval steps: throughput, TFLOP/s, MFU, memory.

The loop times each step with `Timer`, feeds `IntervalStats.add_step`, and at a log step hands
`IntervalStats.summary(...)` to `MetricsWriter.write`, which prints one Megatron-like line,
appends it to the log file and writes TensorBoard scalars. Token and FLOP counts are global
(summed over data-parallel ranks by the loop); `tflops_per_device` divides by the world size.
"""

from __future__ import annotations

import math
import re
import resource
import sys
import time
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch

# Dense peak TFLOP/s by device-name fragment and dtype; source: vendor datasheets, dense (the
# sparse figures are twice these). bf16/fp16 are tensor-core rates (GeForce: FP32 accumulate);
# fp32 is TF32 tensor core where the GPU has it, else plain FP32 (V100). "H100" alone is the
# SXM part, whose CUDA name ("NVIDIA H100 80GB HBM3") does not say SXM.
PEAK_TFLOPS: Dict[str, Dict[str, float]] = {
    "H100": {"bf16": 989.0, "fp16": 989.0, "fp32": 494.5},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "fp32": 378.0},
    "H100 NVL": {"bf16": 835.0, "fp16": 835.0, "fp32": 417.5},
    "H200": {"bf16": 989.0, "fp16": 989.0, "fp32": 494.5},
    "GH200": {"bf16": 989.0, "fp16": 989.0, "fp32": 494.5},
    "H800": {"bf16": 989.0, "fp16": 989.0, "fp32": 494.5},
    "H800 PCIe": {"bf16": 756.0, "fp16": 756.0, "fp32": 378.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 156.0},
    "A800": {"bf16": 312.0, "fp16": 312.0, "fp32": 156.0},
    "A10": {"bf16": 125.0, "fp16": 125.0, "fp32": 62.5},
    "A40": {"bf16": 149.7, "fp16": 149.7, "fp32": 74.8},
    "L40": {"bf16": 181.0, "fp16": 181.0, "fp32": 90.5},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "fp32": 183.0},
    "L4": {"bf16": 121.0, "fp16": 121.0, "fp32": 60.0},
    "V100": {"fp16": 125.0, "fp32": 15.7},
    "V100 PCIe": {"fp16": 112.0, "fp32": 14.0},
    "RTX 4090": {"bf16": 165.2, "fp16": 165.2, "fp32": 82.6},
    "RTX 3090": {"bf16": 71.0, "fp16": 71.0, "fp32": 35.6},
}

_DTYPE_ALIASES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16",
                  "half": "fp16", "fp32": "fp32", "float32": "fp32", "tf32": "fp32"}


def peak_tflops(device_name: str, dtype: str, override: Optional[float] = None) -> Optional[float]:
    """Dense peak TFLOP/s of one device, or None when unknown (then MFU is not shown).

    Args:
        device_name: e.g. torch.cuda.get_device_name(); "-" and "_" count as spaces.
        dtype: bf16/bfloat16, fp16/float16/half, fp32/float32/tf32.
        override: the --peak-tflops value; wins over the table when given.
    The longest table key found in the name as a whole word wins ("A100-SXM4" is an A100, not
    an A10; "L40S" is not an L4).
    Raises:
        ValueError: override is not positive, or dtype is not one of the above.
    """
    if override is not None:
        if override <= 0:
            raise ValueError(f"--peak-tflops must be positive, got {override}")
        return float(override)
    key = _DTYPE_ALIASES.get(dtype.lower())
    if key is None:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPE_ALIASES)}")
    name = re.sub(r"[-_]+", " ", device_name)
    matches = [k for k in PEAK_TFLOPS
               if re.search(rf"(?<![a-z0-9]){re.escape(k)}(?![a-z0-9])", name, re.IGNORECASE)]
    if not matches:
        return None
    return PEAK_TFLOPS[max(matches, key=len)].get(key)


class Timer:
    """Wall time of each step and the part of it spent waiting for data (monotonic clock).

    A step runs from the previous `step_end` (or construction / `reset`) to the next, so the
    steps tile the wall clock; call `reset()` after evaluation or checkpointing to leave them
    out. Call `step_end` after something that waits for the device (reading the loss), or the
    time of queued CUDA work lands in a later step.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self.reset()

    def reset(self) -> None:
        """Start a new step now, forgetting any data wait so far."""
        self._step_start = self._clock()
        self._data_start: Optional[float] = None
        self._data_wait = 0.0

    def data_start(self) -> None:
        """Mark the start of fetching a batch."""
        self._data_start = self._clock()

    def data_end(self) -> None:
        """Mark the end of fetching a batch; raises RuntimeError without a data_start."""
        if self._data_start is None:
            raise RuntimeError("Timer.data_end() called without data_start()")
        self._data_wait += self._clock() - self._data_start
        self._data_start = None

    def step_end(self) -> Tuple[float, float]:
        """End the step; return (step seconds, data-wait seconds) and start the next step."""
        now = self._clock()
        step, wait = now - self._step_start, self._data_wait
        self._step_start, self._data_wait = now, 0.0
        return step, wait


def peak_memory_bytes() -> int:
    """Peak CUDA memory allocated by torch when CUDA is in use, else the process peak RSS."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB


class IntervalStats:
    """Sums over one log interval; `summary` turns them into rates and starts a new interval.

    Skipped steps (loss-scale overflow) count in `skipped`, time, tokens and FLOPs (the work
    was done) but not in the loss or grad norm, which are inf/nan there.
    """

    def __init__(self):
        self._reset()

    def _reset(self) -> None:
        self.steps = self.skipped = 0
        self.loss_sum = self.loss_count = 0.0
        self.grad_norm_sum, self.grad_norm_count = 0.0, 0
        self.input_tokens = self.target_tokens = 0
        self.model_flops = 0.0
        self.elapsed_s = self.data_wait_s = 0.0

    def add_step(self, *, loss_sum: float, loss_count: float, grad_norm: Optional[float],
                 skipped: bool, input_tokens: int, target_tokens: int, model_flops: float,
                 step_time_s: float, data_wait_s: float = 0.0) -> None:
        """Add one optimizer step.

        loss_sum / loss_count: summed loss and what it is summed over (tokens or micro-batches);
        grad_norm: global norm or None; skipped: the step overflowed; input_tokens /
        target_tokens: non-padding encoder / decoder tokens and model_flops (no recomputation),
        all ranks; step_time_s / data_wait_s: from `Timer.step_end`.
        """
        self.steps += 1
        if skipped:
            self.skipped += 1
        else:
            self.loss_sum += float(loss_sum)
            self.loss_count += float(loss_count)
            if grad_norm is not None:
                self.grad_norm_sum += float(grad_norm)
                self.grad_norm_count += 1
        self.input_tokens += int(input_tokens)
        self.target_tokens += int(target_tokens)
        self.model_flops += float(model_flops)
        self.elapsed_s += float(step_time_s)
        self.data_wait_s += float(data_wait_s)

    def summary(self, iteration: int, consumed_samples: int, lr: float,
                loss_scale: Optional[float], world_size: int,
                peak_tflops: Optional[float]) -> Dict[str, Optional[float]]:
        """The interval as a dict (keys: the arguments and the metrics below), then reset.

        loss and grad_norm are means over counted steps (None if none); data_wait_s and
        step_time_s are means per step; rates are None when no time has elapsed; mfu is
        tflops_per_device / peak_tflops, None when the peak is unknown; memory is
        `peak_memory_bytes()`.
        """
        t = self.elapsed_s
        tflops = self.model_flops / t / world_size / 1e12 if t > 0 else None
        steps = max(self.steps, 1)
        out = {
            "iteration": iteration,
            "consumed_samples": consumed_samples,
            "lr": lr,
            "loss": self.loss_sum / self.loss_count if self.loss_count > 0 else None,
            "grad_norm": (self.grad_norm_sum / self.grad_norm_count
                          if self.grad_norm_count else None),
            "loss_scale": loss_scale,
            "skipped": self.skipped,
            "input_tokens_per_s": self.input_tokens / t if t > 0 else None,
            "target_tokens_per_s": self.target_tokens / t if t > 0 else None,
            "tflops_per_device": tflops,
            "mfu": tflops / peak_tflops if tflops is not None and peak_tflops else None,
            "memory": peak_memory_bytes(),
            "data_wait_s": self.data_wait_s / steps,
            "step_time_s": t / steps,
        }
        self._reset()
        return out


def format_line(summary: dict, train_iters: Optional[int]) -> str:
    """One Megatron-like log line; fields whose value is None (MFU on CPU) are left out."""
    s = summary
    parts = [f" iteration {s['iteration']:8d}" + (f"/{train_iters:8d}" if train_iters else "")]
    fields = [("consumed samples", "consumed_samples", "{}"), ("lr", "lr", "{:.3E}"),
              ("loss", "loss", "{:.4E}"), ("grad norm", "grad_norm", "{:.3f}"),
              ("loss scale", "loss_scale", "{:.1f}"), ("skipped", "skipped", "{}")]
    parts += [f"{label}: {fmt.format(s[k])}" for label, k, fmt in fields if s.get(k) is not None]
    if s.get("input_tokens_per_s") is not None:
        parts.append(f"tokens/s in: {s['input_tokens_per_s']:.0f} "
                     f"tgt: {s['target_tokens_per_s']:.0f}")
    if s.get("tflops_per_device") is not None:
        parts.append(f"TFLOP/s/dev: {s['tflops_per_device']:.2f}")
    if s.get("mfu") is not None:
        parts.append(f"MFU: {100 * s['mfu']:.1f}%")
    if s.get("memory") is not None:
        parts.append(f"mem: {s['memory'] / 2**30:.2f} GiB")
    parts += [f"data wait: {s['data_wait_s']:.2f} s", f"step: {s['step_time_s']:.2f} s"]
    from megatron.training import producers  # here: the planner imports this module, and
    # the producers import the model's MoE layer

    parts += producers.line_parts(s)  # the step-metric producers' fields, by name
    return " | ".join(parts)


# TensorBoard tag suffixes that differ from the summary key
_TB_RENAMES = {"input_tokens_per_s": "tokens_per_s", "memory": "memory_bytes"}
_EVAL_LABELS = {"valid": "validation", "test": "test"}
_PPL_LOSS_CAP = 20.0  # exp(20) ~ 4.9e8; beyond that the loss itself says enough


class MetricsWriter:
    """Prints log lines, appends them to a log file and writes TensorBoard scalars (rank 0).

    A disabled writer (non-zero ranks) does nothing and opens nothing.
    Raises OSError when the log file or TensorBoard directory cannot be created.
    """

    def __init__(self, log_file: Optional[str | Path], tensorboard_dir: Optional[str | Path],
                 enabled: bool, train_iters: Optional[int] = None):
        self.enabled, self.train_iters = enabled, train_iters
        self._file = self._tb = None
        if not enabled:
            return
        if log_file is not None:
            Path(log_file).parent.mkdir(parents=True, exist_ok=True)
            # line-buffered and flushed per write: `tail -f` works, a crash loses nothing
            self._file = open(log_file, "a", buffering=1, encoding="utf-8")
        if tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package
            self._tb = SummaryWriter(log_dir=str(tensorboard_dir))

    def write_text(self, msg: str) -> None:
        """Print a free line and append it to the log file."""
        if not self.enabled:
            return
        print(msg, flush=True)
        if self._file is not None:
            self._file.write(msg + "\n")
            self._file.flush()

    def write(self, summary: dict, prefix: str = "train") -> None:
        """Log an `IntervalStats.summary`: the line, then scalars `{prefix}/...` at x=iteration."""
        if not self.enabled:
            return
        self.write_text(format_line(summary, self.train_iters))
        if self._tb is not None:
            for key, value in summary.items():
                if key != "iteration" and value is not None:
                    tag = f"{prefix}/{_TB_RENAMES.get(key, key)}"
                    self._tb.add_scalar(tag, value, summary["iteration"])
            self._tb.flush()

    def write_scalars(self, scalars: Dict[str, float], iteration: int) -> None:
        """TensorBoard scalars {tag: value} at x=iteration (nothing without a TensorBoard
        directory)."""
        if not self.enabled or self._tb is None:
            return
        for tag, value in scalars.items():
            self._tb.add_scalar(tag, value, iteration)
        self._tb.flush()

    def write_eval(self, iteration: int, split: str, loss: float,
                   span_accuracy: Optional[float] = None,
                   accuracy_name: str = "span accuracy") -> None:
        """Log an evaluation loss and its perplexity (exp of the loss capped at 20), and the
        teacher-forced accuracy where known (after the perplexity, under `accuracy_name`:
        "span accuracy" in pretraining, "token accuracy" for seq2seq pairs; TensorBoard
        `{split}/span_accuracy` or `{split}/token_accuracy`).

        Raises ValueError when split is not 'valid' or 'test'.
        """
        if split not in _EVAL_LABELS:
            raise ValueError(f"split must be 'valid' or 'test', got {split!r}")
        if not self.enabled:
            return
        ppl = math.exp(min(loss, _PPL_LOSS_CAP))
        accuracy = "" if span_accuracy is None else \
            f" {accuracy_name}: {span_accuracy:.4f} |"
        self.write_text(f" {_EVAL_LABELS[split]} loss at iteration {iteration} | "
                        f"lm loss: {loss:.4E} | lm loss PPL: {ppl:.4E} |{accuracy}")
        if self._tb is not None:
            self._tb.add_scalar(f"{split}/loss", loss, iteration)
            self._tb.add_scalar(f"{split}/ppl", ppl, iteration)
            if span_accuracy is not None:
                self._tb.add_scalar(f"{split}/{accuracy_name.replace(' ', '_')}",
                                    span_accuracy, iteration)
            self._tb.flush()

    def write_eval_samples(self, iteration: int, split: str,
                           samples: Sequence[Tuple[str, str, str]]) -> None:
        """Log decoded evaluation examples, (input, target, fill) each, as the lines
        `sample k input: ...`, `sample k target: ...`, `sample k fill: ...`, and write them to
        TensorBoard as the text `{split}/samples` (a code block: sentinels such as
        <extra_id_0> would read as HTML tags)."""
        if split not in _EVAL_LABELS:
            raise ValueError(f"split must be 'valid' or 'test', got {split!r}")
        if not self.enabled or not samples:
            return
        # one line per field: a newline inside a text is written as backslash-n
        lines = [f"sample {k} {field}: " + text.replace("\n", "\\n")
                 for k, sample in enumerate(samples)
                 for field, text in zip(("input", "target", "fill"), sample)]
        for line in lines:
            self.write_text(line)
        if self._tb is not None:
            self._tb.add_text(f"{split}/samples", "\n".join("    " + line for line in lines),
                              iteration)
            self._tb.flush()

    def close(self) -> None:
        """Flush and close the log file and TensorBoard writer; safe to call twice."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

