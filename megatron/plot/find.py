"""Where a RUN argument's series are, and reading them into a `Run`.

A RUN argument is a log file, a TensorBoard events file or folder, or a folder: a `--save`
folder (its newest meta.json names the run's --log-file and --tensorboard-dir), a folder holding
`log.txt`, or one whose subfolder holds events files. The log is preferred when both exist: it
also records where each start resumed.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from megatron.checkpoint.formats.deepspeed_files import CheckpointReadError
from megatron.checkpoint.formats.meta import read_meta
from megatron.checkpoint.layout import ITERATION_PREFIX, iteration_of_folder
from megatron.plot.events import read_events
from megatron.plot.logfile import read_log
from megatron.plot.runs import Run, events_files, is_events_file

LOG_NAMES = ("log.txt", "train.log", "log")
"""Files a folder may hold its log under, when no meta.json names one."""
GENERIC_NAMES = {*LOG_NAMES, "tb", "tensorboard", "logs", "ckpt", "checkpoint", "checkpoints"}
"""Path components that say nothing about which run it is: left out of default labels."""


def default_labels(runs: Sequence[str | Path]) -> List[str]:
    """Short legend names for RUN arguments: the last path component that is not generic
    (`exp1/ckpt` -> exp1, `exp2/log.txt` -> exp2, `exp3/tb` -> exp3), with more components in
    front as long as two runs would share a name; runs that only differ in a generic component
    (`exp1/ckpt` and `exp1/tb`) keep it."""
    full = [list(Path(run).resolve().parts[1:]) or [str(run)] for run in runs]
    stripped = []
    for names in full:
        names = list(names)
        while len(names) > 1 and (names[-1] in GENERIC_NAMES or "tfevents" in names[-1]):
            names.pop()
        stripped.append(names)
    for parts in (stripped, full):
        for depth in range(1, max(len(p) for p in parts) + 1):
            labels = ["/".join(p[-depth:]) for p in parts]
            if len(set(labels)) == len(labels):
                return labels
    return [str(run) for run in runs]


class RunNotFound(ValueError):
    """A RUN argument holds neither a log file nor TensorBoard events (the message names it)."""


def newest_meta(folder: Path) -> Optional[dict]:
    """The newest `iter_*/meta.json` of a --save folder, parsed (None: none readable)."""
    found = []
    for meta in folder.glob(f"{ITERATION_PREFIX}*/meta.json"):
        iteration = iteration_of_folder(meta.parent.name)
        if iteration is not None:
            found.append((iteration, meta))
    for _, meta in sorted(found, reverse=True):
        try:
            return read_meta(meta.parent)
        except CheckpointReadError:
            continue  # a damaged one: the next older
    return None


def _flag_path(value, flags: dict, folder: Path) -> Optional[Path]:
    """A path from a checkpoint's flags, found where it is now: inside the --save folder if it
    was inside it then (the folder may have been moved or copied since), else as written, else
    by its name inside the folder."""
    if not value:
        return None
    path = Path(value)
    candidates = [path, folder / path.name]
    try:
        candidates.insert(0, folder / path.relative_to(flags.get("save") or ""))
    except ValueError:
        pass
    return next((c for c in candidates if c.exists()), None)


def resolve(run: str | Path, source: str = "auto") -> Tuple[str, Path]:
    """Where a RUN argument's series are: ('log', file) or ('tensorboard', folder or file).

    source: 'auto' (the log when there is one, else the events), 'log' or 'tensorboard'.
    Raises:
        RunNotFound: nothing of that kind there; the message names the path and what was
            looked for.
    """
    path = Path(run)
    if not path.exists():
        raise RunNotFound(f"{path}: no such file or folder")
    logs: List[Path] = []
    events: List[Path] = []
    if path.is_file():
        (events if is_events_file(path) else logs).append(path)
    else:
        flags = (newest_meta(path) or {}).get("flags") or {}
        logs += [p for p in [_flag_path(flags.get("log_file"), flags, path)] if p and p.is_file()]
        logs += [path / name for name in LOG_NAMES if (path / name).is_file()]
        tb = _flag_path(flags.get("tensorboard_dir"), flags, path)
        if tb is not None and events_files(tb):
            events.append(tb)
        if events_files(path):
            events.append(path)
        events += sorted(sub for sub in path.iterdir() if sub.is_dir() and events_files(sub))
    if source in ("auto", "log") and logs:
        return "log", logs[0]
    if source in ("auto", "tensorboard") and events:
        return "tensorboard", events[0]
    wanted = {"auto": "neither a log file nor TensorBoard events", "log": "no log file",
              "tensorboard": "no TensorBoard events"}[source]
    raise RunNotFound(f"{path}: {wanted} found (looked for the --log-file and "
                      f"--tensorboard-dir named by a checkpoint's meta.json, "
                      f"{', '.join(LOG_NAMES)}, and *tfevents* files in the folder and its "
                      f"subfolders)")


def load_run(run: str | Path, label: Optional[str] = None, source: str = "auto") -> Run:
    """Read a RUN argument (see `resolve`) into a Run labelled `label` (default:
    `default_labels`).

    Raises:
        RunNotFound: see `resolve`; also a log file in which no metrics line was found.
    """
    kind, path = resolve(run, source)
    label = label or default_labels([run])[0]
    result = (read_log if kind == "log" else read_events)(path, label)
    if not result.steps and not result.evals and not result.layers:
        raise RunNotFound(f"{path}: no metrics logged there (no 'iteration N | consumed "
                          f"samples' lines or train/ scalars)")
    if result.encoder_seq_length is None and kind == "tensorboard" and Path(run).is_dir():
        flags = (newest_meta(Path(run)) or {}).get("flags") or {}
        result.encoder_seq_length = flags.get("encoder_seq_length")
    return result
