"""The folder of a checkpoint our trainer writes: the tracker and the iteration folders (their
names: megatron/checkpoint/layout.py; their meta.json: meta.py), and hints when the folder is
another tool's.
The reader built on it: megatron/checkpoint/formats/deepspeed.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional, Union

from megatron.checkpoint.formats.deepspeed_experts import expert_files, expert_size
from megatron.checkpoint.formats.deepspeed_files import CheckpointReadError, Files
from megatron.checkpoint.layout import (
    ITERATION_PREFIX,
    TRACKER,
    TrackerError,
    iteration_folder_name,
    read_tracker,
)
from megatron.checkpoint.formats.meta import META, foreign_hint

LAYERS_FILE = "pipeline_layers.json"

PathLike = Union[str, Path]


def find_iteration(ckpt_dir: PathLike, iteration: Optional[int] = None) -> Path:
    """The iteration folder to read: `iteration`'s, else the tracker's. An iteration folder
    itself (one holding meta.json) is returned as it is.

    Raises:
        CheckpointReadError: no such folder, a missing or garbled tracker, a missing iteration.
    """
    root = Path(ckpt_dir)
    if not root.is_dir():
        raise CheckpointReadError(f"{root}: no such checkpoint folder")
    if iteration is None and (root / META).is_file():
        return root
    tracker = root / TRACKER
    from_tracker = iteration is None
    if from_tracker:
        if not tracker.is_file():
            found = _iteration_folders(root)
            hint = (f"; it has {', '.join(found[-3:])}: pass the iteration to read one"
                    if found else "")
            raise CheckpointReadError(f"{tracker}: missing, so {root} holds no complete "
                                      f"checkpoint of our trainer{hint}{foreign_hint(root)}")
        try:
            iteration = read_tracker(root, hint="pass the iteration to read")
        except TrackerError as e:
            raise CheckpointReadError(str(e)) from None
    folder = root / iteration_folder_name(iteration)
    if not folder.is_dir():
        found = _iteration_folders(root)
        said = f" ({tracker.name} names it)" if from_tracker else ""
        raise CheckpointReadError(f"{folder}: missing{said}; iterations in {root}: "
                                  f"{', '.join(found) or 'none'}")
    return folder


def _iteration_folders(root: Path) -> List[str]:
    return sorted(p.name for p in root.glob(ITERATION_PREFIX + "*") if p.is_dir())


def expected_files(folder: Path, layout: Dict[str, int], precision: str) -> List[str]:
    """DeepSpeed's model and optimizer files (and the pipeline's tied files) for the layout."""
    tp, pp, dp = (layout["tensor_model_parallel_size"], layout["pipeline_model_parallel_size"],
                  layout["data_parallel_size"])
    zero, files = layout["zero_stage"], Files(folder)
    names = []
    for m in range(tp * pp):
        names += ([f"zero_pp_rank_{d}_mp_rank_{m:02d}_model_states.pt" for d in range(dp)]
                  if zero == 3 else [f"mp_rank_{m:02d}_model_states.pt"])
        if zero > 0:
            names += [files.zero_name(d, m, precision == "bf16") for d in range(dp)]
    if pp > 1:
        names.append(LAYERS_FILE)
    if pp > 1 and expert_size(layout) == 1:  # with experts over ranks DeepSpeed's MoE layout:
        try:  # no tied files
            keys = list(json.loads((folder / LAYERS_FILE).read_text())["tied"])
        except (OSError, ValueError, KeyError):
            keys = []
        names += [f"tied_{k}-model_{t:02d}-model_states.pt" for k in keys for t in range(tp)]
    return names + expert_files(layout)
