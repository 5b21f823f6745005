"""The names in a checkpoint folder, defined once: the tracker file and the iteration folders.

    ROOT/latest_checkpointed_iteration.txt   the tracker: the newest complete iteration as a
                                            plain number, written last (Megatron-LM's name;
                                            its release checkpoints say 'release' instead)
    ROOT/latest                             the same iteration's folder name, for DeepSpeed's
                                            own tools (zero_to_fp32.py)
    ROOT/iter_0001000/                      an iteration folder of our trainer and of the
                                            conversion tool (Megatron-LM's iter_%07d); CPM-2
                                            names it by the bare number instead

Every reader and writer of such a folder takes the names from here: the trainer's saves and
loads (io/checkpointing.py, io/saver.py), the reader of our checkpoints
(formats/deepspeed_folder.py), the weights checkpoints (formats/weights.py) and CPM-2's
(formats/cpm2.py). What an iteration folder holds is each format's own.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, List, Optional, Tuple, Union

TRACKER = "latest_checkpointed_iteration.txt"
DEEPSPEED_LATEST = "latest"
RELEASE = "release"
"""What Megatron-LM's tracker holds for a release checkpoint (folder ROOT/release)."""
ITERATION_PREFIX = "iter_"

_NUMBER = re.compile(r"[0-9]+")


class TrackerError(ValueError):
    """A tracker file that names no iteration; the message names the file."""


def iteration_folder_name(iteration: int) -> str:
    """The folder of `iteration`: iter_0001000."""
    return f"{ITERATION_PREFIX}{int(iteration):07d}"


def iteration_of_folder(name: str) -> Optional[int]:
    """The iteration an `iteration_folder_name` names; None for any other name (iter_N.tmp,
    iter_N.removing, other files)."""
    suffix = name[len(ITERATION_PREFIX):] if name.startswith(ITERATION_PREFIX) else ""
    return int(suffix) if _NUMBER.fullmatch(suffix) else None


def iteration_folders(root: Path) -> List[Tuple[int, Path]]:
    """(iteration, folder) of every complete iteration folder of `root`, oldest first."""
    found = ((iteration_of_folder(p.name), p) for p in Path(root).glob(ITERATION_PREFIX + "*")
             if p.is_dir())
    return sorted((n, p) for n, p in found if n is not None)


def read_tracker(root: Path, release_ok: bool = False,
                 hint: str = "") -> Optional[Union[int, str]]:
    """The iteration the tracker of `root` names; None when `root` has no tracker.

    release_ok: 'release' (Megatron-LM's release checkpoint) is returned as RELEASE instead of
        refused.
    hint: appended to the message of a tracker that holds no number (what to do instead).
    Raises:
        TrackerError: the tracker holds neither a number nor (where taken) 'release'.
    """
    tracker = Path(root) / TRACKER
    if not tracker.is_file():
        return None
    text = tracker.read_text(encoding="utf-8", errors="replace").strip()
    if text == RELEASE:
        if release_ok:
            return RELEASE
        raise TrackerError(f"{tracker} says 'release': a Megatron-LM release checkpoint, not "
                           f"one written by this trainer")
    if not _NUMBER.fullmatch(text):
        raise TrackerError(f"{tracker} holds {text[:40]!r}, not an iteration number"
                           f"{'; ' + hint if hint else ''}")
    return int(text)


def _write_text(path: Path, text: str) -> None:
    path.write_text(text)


def write_tracker(root: Path, iteration: int,
                  write: Callable[[Path, str], None] = _write_text) -> None:
    """Name `iteration` the newest complete checkpoint of `root`: the tracker, then DeepSpeed's
    'latest' file. write(path, text): how each file is written (the trainer's saves write
    each to a temporary name and rename it)."""
    root = Path(root)
    write(root / TRACKER, f"{iteration}\n")
    write(root / DEEPSPEED_LATEST, iteration_folder_name(iteration))
