"""Read a run's `--log-file` (or its captured stdout) into a `Run`.

The lines read are those megatron/training/metrics.py and the entry point write:

    flags: {...}                                        a start begins (its flags as JSON)
    resumed from DIR at iteration 300 (...)             ... and resumed at iteration 300
     iteration      310/    1000 | consumed samples: 2480 | lr: 1.000E-04 | loss: 6.1234E+00 |
        grad norm: 1.234 | ... | tokens/s in: 4231 tgt: 926 | ... | mem: 0.35 GiB | ... |
        step: 0.06 s
     validation loss at iteration 320 | lm loss: 6.0123E+00 | lm loss PPL: 4.0853E+02 |
     grad norm per layer at iteration 320: embedding 1.234E-01, encoder.block.0 5.678E-02, ...

Other lines are skipped, and the patterns are searched anywhere in a line, so a prefix (a
launcher's "0: " or "[rank0]:") does no harm. A start's earlier-logged steps after its resume
iteration are dropped when its first line of numbers arrives (`Run.begin_start`); a start that
never got that far changes nothing. Values are taken as printed (the line rounds them).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Dict, Iterable, Optional

from megatron.plot.runs import Run

_TRAIN = re.compile(r"(?:^|\s)iteration\s+(\d+)(?:/\s*\d+)?\s+\|\s*(consumed samples:.*)$")
_EVAL = re.compile(r"(?:^|\s)(validation|test) loss at iteration (\d+) \| lm loss: (\S+)")
_LAYERS = re.compile(r"(?:^|\s)grad norm per layer at iteration (\d+):\s*(.*?)\s*$")
_RESUMED = re.compile(r"(?:^|\s)resumed from .* at iteration (\d+) \(")
_FLAGS = "flags: {"
_NUMBER = r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|nan|inf|-inf)"

# label in the metrics line -> (Run.train name, pattern of its value, scale)
_FIELDS = {
    "consumed samples": ("consumed_samples", _NUMBER, 1.0),
    "lr": ("lr", _NUMBER, 1.0),
    "loss": ("loss", _NUMBER, 1.0),
    "grad norm": ("grad_norm", _NUMBER, 1.0),
    "loss scale": ("loss_scale", _NUMBER, 1.0),
    "skipped": ("skipped", _NUMBER, 1.0),
    "TFLOP/s/dev": ("tflops_per_device", _NUMBER, 1.0),
    "MFU": ("mfu", _NUMBER + "%", 0.01),
    "mem": ("memory_gib", _NUMBER + " GiB", 1.0),
    "data wait": ("data_wait_s", _NUMBER + " s", 1.0),
    "step": ("step_time_s", _NUMBER + " s", 1.0),
}
_FIELDS = {label: (name, re.compile(pattern), scale)
           for label, (name, pattern, scale) in _FIELDS.items()}
_TOKENS = re.compile(rf"^{_NUMBER} tgt: {_NUMBER}$")
_SPLITS = {"validation": "valid", "test": "test"}


def parse_train_fields(text: str) -> Dict[str, float]:
    """The fields of a metrics line after 'iteration N |', by Run.train name; fields this
    reader does not know are skipped, so that a longer line still reads."""
    out: Dict[str, float] = {}
    for part in text.split("|"):
        label, sep, value = part.partition(":")
        label, value = label.strip(), value.strip()
        if not sep:
            continue
        if label == "tokens/s in":
            m = _TOKENS.match(value)
            if m:
                out["tokens_per_s"], out["target_tokens_per_s"] = float(m[1]), float(m[2])
            continue
        known = _FIELDS.get(label)
        if known is None:
            continue
        name, pattern, scale = known
        m = pattern.fullmatch(value)
        if m:
            out[name] = float(m[1]) * scale
    return out


def parse_layer_norms(text: str) -> Dict[str, float]:
    """'embedding 1.234E-01, encoder.block.0 5.678E-02, ...' -> {group: norm}."""
    out = {}
    for item in text.split(","):
        name, _, value = item.strip().rpartition(" ")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            continue
    return {k: v for k, v in out.items() if k}


class _Starts:
    """Tracks the starts of a log: where the current one resumed, whether it has begun adding
    points (then earlier starts' later steps are dropped), and its last metrics line."""

    def __init__(self, run: Run):
        self.run = run
        self.resumed_at: Optional[int] = None
        self.begun = False
        self.last: Optional[int] = None

    def new_start(self) -> None:
        self.resumed_at, self.begun, self.last = 0, False, None

    def before_point(self, train_iteration: Optional[int] = None) -> None:
        """Called before a point is added; `train_iteration` for a metrics line."""
        if self.resumed_at is None:  # a log without flags lines: its first start
            self.new_start()
        elif train_iteration is not None and self.last is not None \
                and train_iteration <= self.last:
            # the steps went back without a flags line (lines of starts concatenated):
            # a start that resumed before this iteration
            self.new_start()
            self.resumed_at = train_iteration - 1
        if not self.begun:
            self.run.begin_start(self.resumed_at)
            self.begun = True


def parse_lines(lines: Iterable[str], run: Run) -> Run:
    """Add the series of a log's lines to `run` (see the module docstring); returns it."""
    starts = _Starts(run)
    for line in lines:
        if "iteration" not in line and _FLAGS not in line:  # most lines of a long log: fast
            continue
        if _FLAGS in line:
            starts.new_start()
            try:
                flags = json.loads(line[line.index(_FLAGS) + len("flags: "):])
            except ValueError:
                flags = {}
            if isinstance(flags, dict) and flags.get("encoder_seq_length"):
                run.encoder_seq_length = int(flags["encoder_seq_length"])
            continue
        m = _RESUMED.search(line) if "resumed from" in line else None
        if m:
            if starts.resumed_at is None or starts.begun:  # a resume line without flags
                starts.new_start()
            starts.resumed_at = int(m[1])
            continue
        m = _TRAIN.search(line)
        if m:
            iteration = int(m[1])
            starts.before_point(iteration)
            since = starts.last if starts.last is not None else starts.resumed_at
            run.add_train(iteration, parse_train_fields(m[2]), iteration - since)
            starts.last = iteration
            continue
        m = _EVAL.search(line)
        if m:
            iteration = int(m[2])
            starts.before_point()
            try:
                run.add_eval(iteration, _SPLITS[m[1]], float(m[3]))
            except ValueError:
                pass
            continue
        m = _LAYERS.search(line)
        if m:
            starts.before_point()
            run.add_layers(int(m[1]), parse_layer_norms(m[2]))
    return run


def read_log(path: Path, label: str) -> Run:
    """A log file's series as a Run. Raises OSError when it cannot be read."""
    with open(path, encoding="utf-8", errors="replace") as f:
        return parse_lines(f, Run(label=label, source=Path(path)))
