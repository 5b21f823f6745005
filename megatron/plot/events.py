"""Read a run's TensorBoard scalars (`--tensorboard-dir`) into a `Run`.

The tags are those megatron/training/metrics.py writes: `train/<metric>` at each log step
(`train/tokens_per_s` is the input tokens, `train/memory_bytes` the peak memory),
`valid/loss` and `test/loss`, and `grad-norm-per-layer/<group>`. Each start of the trainer opens
a new events file; the files are read in the order they were opened (their first event's wall
time), and each is a start that resumed just before its lowest step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Tuple

from megatron.plot.runs import EVAL_SPLITS, Run, events_files, is_events_file

_RENAMES = {"memory_bytes": ("memory_gib", 1.0 / 2**30)}
LAYER_PREFIX = "grad-norm-per-layer/"


def _scalars(path: Path) -> Tuple[float, List[Tuple[int, str, float]]]:
    """(wall time of the first event, [(step, tag, value)]) of one events file."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util import tensor_util

    first, out = None, []
    for event in EventFileLoader(str(path)).Load():
        if first is None:
            first = event.wall_time
        for value in event.summary.value:
            kind = value.WhichOneof("value")
            if kind == "simple_value":
                number = float(value.simple_value)
            elif kind == "tensor":
                array = tensor_util.make_ndarray(value.tensor)
                if array.size != 1 or array.dtype.kind not in "fiu":
                    continue
                number = float(array.reshape(()))
            else:
                continue
            out.append((int(event.step), value.tag, number))
    return (first if first is not None else 0.0), out


def read_events(path: Path, label: str) -> Run:
    """The scalars of an events folder (or one events file) as a Run.

    Raises:
        OSError: a file cannot be read.
    """
    path = Path(path)
    files = [path] if is_events_file(path) else events_files(path)
    opened = sorted((_scalars(f) + (f.name,) for f in files), key=lambda t: (t[0], t[2]))
    run = Run(label=label, source=path)
    for _, scalars, _ in opened:
        if not scalars:
            continue
        run.begin_start(min(step for step, _, _ in scalars) - 1)
        train: Dict[int, Dict[str, float]] = {}
        for step, tag, number in scalars:
            prefix, _, name = tag.partition("/")
            if prefix == "train":
                name, scale = _RENAMES.get(name, (name, 1.0))
                train.setdefault(step, {})[name] = number * scale
            elif prefix in EVAL_SPLITS and name == "loss":
                run.add_eval(step, prefix, number)
            elif tag.startswith(LAYER_PREFIX):
                run.layers.setdefault(step, {})[tag[len(LAYER_PREFIX):]] = number
        previous = run.last_train_iteration()
        for step in sorted(train):
            run.add_train(step, train[step], step - previous)
            previous = step
    return run
