"""Where a NaN started: the first module whose output or gradient is not finite.

When the NaN guard stops a run (`--check-for-nan-in-loss-and-grad`, loop.py), the loop asks the
step to run the failing step's micro-batches again, forward and backward, with a
`NonFiniteWatch` on the model: hooks that note, in execution order, whether each module's
forward output, each module's input gradient (full backward hooks) and each parameter's
gradient is finite. The first note that is not finite names the place, by the model's own module
names (`encoder.block.2.layer.1.DenseReluDense.wo`); a forward finding comes before every
backward one of its micro-batch, since backward runs after forward. With `--detect-nan-layers`
the watch is on during every real step (one `isfinite` reduction per module and parameter per
micro-batch: slower), and the report comes from the failing step itself, without a re-run.

The re-run is faithful because the step (step.py, DataParallelStep) keeps its micro-batches,
the random generators' states at its start (the same dropout masks), and holds back the update
of a step that is not finite on any rank (one all-reduce per step), so the weights are those the
step failed with. fp16 steps are left to DeepSpeed's overflow skipping. The guard stops at a
non-finite loss or gradient norm; a module output that is not finite while both stay finite
(rare: an RMS norm turns inf into NaN) does not stop a run, with or without the flag.

The notes are device flags (no host synchronisation inside the hooks); `first()` reads them with
one synchronisation. Each rank that finds something has one line, gathered on rank 0, which
prints it and appends it to the log file.
"""

from __future__ import annotations

import math
import warnings
from typing import Iterable, List, NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import nn

from megatron.training.step_metrics import MAX, Metrics, metric

ROOT = "the model's output (head and loss)"
"""The name reported for the root module: its forward adds the head and the loss."""


class Finding(NamedTuple):
    micro_batch: int
    """0-based micro-batch of the step."""
    phase: str
    """'forward output', 'backward input gradient' or 'backward parameter gradient'."""
    name: str
    """The module (or parameter) name in the model."""

    def where(self) -> str:
        return f"in the {self.phase} of {self.name}"


def _tensors(value) -> Iterable[torch.Tensor]:
    """The floating-point tensors in a module's output or gradients (tuples, named tuples,
    lists and dicts searched; None and integer tensors skipped)."""
    if torch.is_tensor(value):
        if value.is_floating_point():
            yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


class NonFiniteWatch:
    """Hooks on every module and parameter of `model` that note whether values are finite.

    attach() / detach() add and remove the hooks; new_micro_batch() numbers what follows;
    first() is the earliest note that was not finite (None: all finite); reset() forgets."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._handles: list = []
        self._notes: List[Finding] = []
        self._flags: List[torch.Tensor] = []  # bool scalars: True where not finite
        self._micro = 0

    def attach(self) -> "NonFiniteWatch":
        if self._handles:
            return self
        # Modules whose inputs need no gradient (the embedding, on ids) get their hook with
        # the output gradients instead, and torch says so on every backward: expected here.
        warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients "
                                "are computed with respect to module outputs")
        for name, module in self.model.named_modules():
            name = name or ROOT
            self._handles.append(module.register_forward_hook(self._forward_hook(name)))
            self._handles.append(module.register_full_backward_hook(self._backward_hook(name)))
        for name, p in self.model.named_parameters():
            if p.requires_grad:
                self._handles.append(p.register_hook(self._parameter_hook(name)))
        return self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def reset(self) -> None:
        self._notes, self._flags, self._micro = [], [], 0

    def new_micro_batch(self, index: int) -> None:
        self._micro = index

    def first(self) -> Optional[Finding]:
        """The earliest non-finite note (one host synchronisation)."""
        if not self._flags:
            return None
        bad = torch.stack(self._flags).nonzero()
        return self._notes[int(bad[0, 0])] if bad.numel() else None

    # Hooks -----------------------------------------------------------------------------------
    def _note(self, phase: str, name: str, value) -> None:
        flags = [~torch.isfinite(t).all() for t in _tensors(value)]
        if not flags:
            return
        flag = flags[0] if len(flags) == 1 else torch.stack(flags).any()
        self._notes.append(Finding(self._micro, phase, name))
        self._flags.append(flag)

    def _forward_hook(self, name: str):
        def hook(module, inputs, output):
            self._note("forward output", name, output)
        return hook

    def _backward_hook(self, name: str):
        def hook(module, grad_input, grad_output):
            self._note("backward input gradient", name, grad_input)
        return hook

    def _parameter_hook(self, name: str):
        def hook(grad):
            self._note("backward parameter gradient", name, grad)
        return hook


class GradientCheck:
    """Whether any parameter gradient of this rank's backward passes was not finite, for the
    engines that compute the gradient norm only inside their update (ZeRO 1-3, bf16): parameter
    hooks add every gradient's sum into one float64 device scalar (no host synchronisation; a
    sum is NaN or infinite exactly when an element is, float64 does not overflow from finite
    float32 or bf16 gradients), read where the step decides whether to apply the update."""

    def __init__(self, model: nn.Module, device) -> None:
        self.total = torch.zeros((), dtype=torch.float64, device=device)
        self._handles = [p.register_hook(self._hook) for p in model.parameters()
                         if p.requires_grad]

    def _hook(self, grad: torch.Tensor) -> None:
        self.total += grad.sum(dtype=torch.float64)

    @property
    def bad(self) -> torch.Tensor:
        return ~torch.isfinite(self.total)

    def reset(self) -> None:
        self.total.zero_()

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def report_line(finding: Optional[Finding], iteration: int, micro_batches: int) -> Optional[str]:
    """This rank's report line (None: it found nothing)."""
    if finding is None:
        return None
    line = (f"non-finite values first appeared on rank {dist.get_rank()} at iteration "
            f"{iteration} {finding.where()}")
    if micro_batches > 1:
        line += f" (micro-batch {finding.micro_batch + 1} of {micro_batches})"
    return line


def locate(step, iteration: int, writer) -> str:
    """After the guard fired at `iteration`: find where the step's non-finite values started
    (collective: every rank calls it). Every rank's line is gathered on rank 0, which prints
    it and appends it to the log file. Returns the text for the error message: the
    lowest rank's line."""
    how = step.locate_nonfinite()
    if how is None:
        text = ("the locator of non-finite values (which module) is not available with a "
                "pipeline; a run with --pipeline-model-parallel-size 1 on the same weights and "
                "data finds it")
        writer.write_text(text)
        return text
    finding, found_by = how
    mine = report_line(finding, iteration, step.micro_batches)
    if mine is not None and found_by == "updated":
        mine += (" (a re-run on the weights after the step's update, which was not held back: "
                 "fp16, or a gradient norm that overflowed from finite gradients)")
    lines: list = [None] * dist.get_world_size()
    dist.all_gather_object(lines, mine)
    lines = [x for x in lines if x is not None]
    for line in lines:  # rank 0 prints and logs every rank's line (no duplicates on stdout)
        writer.write_text(line)
    if not lines:
        text = (f"the re-run of iteration {iteration} on the same batches found every module's "
                f"output and gradient finite (not reproducible: a hardware fault, or dropout "
                f"masks that differ in the re-run)" if found_by != "watched" else
                f"no module's output or gradient was non-finite at iteration {iteration}")
        writer.write_text(text)
        return text
    return lines[0]


# The NaN guard's numbers in the stop all-reduce ----------------------------------------------------
def guard_metrics(result, device) -> Metrics:
    """This rank's MAX step metrics for the NaN guard: 'nonfinite/loss' and
    'nonfinite/grad_norm', each world size - this rank if that value is not finite here, else 0
    (so the MAX names the lowest such rank, the one whose line the locator reports first). An
    fp16 step that overflowed was skipped by DeepSpeed and changed nothing: not counted."""
    rank = float(dist.get_world_size() - dist.get_rank())
    if result.skipped:
        return {"nonfinite/loss": metric(0.0, MAX, device),
                "nonfinite/grad_norm": metric(0.0, MAX, device)}
    loss_bad = (~torch.isfinite(result.loss.to(device))).double() * rank
    norm = result.grad_norm
    norm_bad = rank if norm is not None and not math.isfinite(norm) else 0.0
    return {"nonfinite/loss": metric(loss_bad, MAX, device),
            "nonfinite/grad_norm": metric(norm_bad, MAX, device)}


def guard_finding(values) -> Optional[str]:
    """What the reduced `guard_metrics` say (None: everything finite on every rank)."""
    loss_rank, norm_rank = (int(float(values.get(f"nonfinite/{name}", 0.0)))
                            for name in ("loss", "grad_norm"))
    if not (loss_rank or norm_rank):
        return None
    what = "the loss" if loss_rank else "the gradient norm"
    seen = dist.get_world_size() - (loss_rank or norm_rank)
    return f"{what} is not finite (seen by rank {seen}" \
        + (", and the gradient norm too" if loss_rank and norm_rank else "") + ")"
