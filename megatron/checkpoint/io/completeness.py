"""Whether a checkpoint of ours holds every file a run needs, whole, found before anything
starts: the check behind `--load` (and `--ckpt-step`) in megatron/arguments.py's
resume_problems, and again on rank 0 when the run loads (the folder may have changed since).

Every save records, in meta.json (written before the folder is renamed and the tracker moves),
the size of each file every rank wrote (`file_sizes`: path in the iteration folder -> bytes). A
missing file, or one whose size differs from the save's (cut short by a copy, a sync tool, a
full disk), is named with the newest earlier iteration that is complete. A checkpoint saved
before the sizes were recorded is checked against the files its saved layout implies (DeepSpeed's
model and optimizer files, the experts', the pipeline's, one RNG file per rank), for presence
only; the message says so.

What a run reads depends on its flags: the optimizer files are not needed with --no-load-optim
or --finetune (but under ZeRO-3, where they hold the weights), the RNG files not with
--no-load-rng or --finetune.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from megatron.checkpoint.formats.deepspeed_files import CheckpointReadError
from megatron.checkpoint.formats.deepspeed_folder import expected_files
from megatron.checkpoint.formats.meta import META, is_weights_format, precision_of, read_meta
from megatron.checkpoint.layout import iteration_folder_name, iteration_folders

MANIFEST = "file_sizes"
"""meta.json's key: {path inside the iteration folder (POSIX): bytes} of every file but
meta.json itself, recorded when the save is committed."""

RNG_FOLDER = "rng"


def manifest(folder: Path) -> Dict[str, int]:
    """The sizes of every file under `folder` but meta.json, for meta.json's MANIFEST."""
    sizes = {}
    for parent, _, names in os.walk(folder):
        for name in names:
            path = Path(parent) / name
            relative = path.relative_to(folder).as_posix()
            if relative != META:
                sizes[relative] = path.stat().st_size
    return dict(sorted(sizes.items()))


def needed(name: str, load_optimizer: bool, load_rng: bool) -> bool:
    """Whether a run with these flags reads the file `name` (a path inside the folder)."""
    if name.startswith(RNG_FOLDER + "/"):
        return load_rng
    if name.endswith("optim_states.pt"):  # ZeRO's and DeepSpeed's expert optimizer files
        return load_optimizer
    return True


def required_files(folder: Path, meta: Dict) -> Tuple[Dict[str, Optional[int]], bool]:
    """(path -> the saved size, or None where unknown; whether the sizes are known): from
    meta.json's MANIFEST, or for a checkpoint saved without one from its saved layout."""
    if isinstance(meta.get(MANIFEST), dict):
        return {str(k): int(v) for k, v in meta[MANIFEST].items()}, True
    names = expected_files(folder, meta["layout"], precision_of(meta))
    names += [f"{RNG_FOLDER}/rank_{r:05d}.pt" for r in range(int(meta.get("world_size", 0)))]
    return {name: None for name in names}, False


def missing_or_short(folder: Path, meta: Dict, load_optimizer: bool = True,
                     load_rng: bool = True) -> Optional[str]:
    """The first file a run with these flags needs that is missing or not of its saved size, as
    a phrase naming it (None: all there and whole). A checkpoint saved without sizes adds that
    only presence was checked."""
    files, sized = required_files(folder, meta)
    # ZeRO-3 saves no weights in the model files: its optimizer files hold them
    load_optimizer = load_optimizer or (meta.get("layout") or {}).get("zero_stage") == 3
    for name, size in files.items():
        if not needed(name, load_optimizer, load_rng):
            continue
        path = folder / name
        try:
            found = path.stat().st_size if path.is_file() else None
        except OSError:  # gone meanwhile
            found = None
        if found is None:
            what = f"{path} is missing"
        elif size is not None and found != size:
            what = f"{path} has {found} bytes, the save wrote {size}"
        else:
            continue
        return what if sized else (what + " (saved before checkpoints recorded their file "
                                          "sizes: only the files' presence was checked)")
    return None


def folder_problem(folder: Path, load_optimizer: bool = True,
                   load_rng: bool = True) -> Optional[str]:
    """Why the iteration folder cannot be loaded whole (a phrase), or None."""
    try:
        meta = read_meta(folder)
    except CheckpointReadError as e:  # missing, not JSON, or no layout of ours
        return str(e)
    if is_weights_format(meta):
        return None  # a weights checkpoint (formats/weights.py) is checked by its reader
    return missing_or_short(folder, meta, load_optimizer, load_rng)


def complete_iterations(root: Path, load_optimizer: bool = True,
                        load_rng: bool = True) -> List[int]:
    """The iterations of `root` whose folders are complete for such a run, oldest first."""
    return [n for n, folder in iteration_folders(root)
            if folder_problem(folder, load_optimizer, load_rng) is None]


def incomplete(root: Path, iteration: int, load_optimizer: bool = True,
               load_rng: bool = True) -> Optional[str]:
    """Why the checkpoint of `iteration` in `root` cannot be loaded whole, naming the first
    missing or short file and the newest earlier iteration that is complete (with the flag that
    loads it); None when it can."""
    problem = folder_problem(Path(root) / iteration_folder_name(iteration), load_optimizer,
                             load_rng)
    if problem is None:
        return None
    earlier = [n for n in complete_iterations(Path(root), load_optimizer, load_rng)
               if n < iteration]
    hint = (f"iteration {earlier[-1]} is complete: resume from it with --ckpt-step "
            f"{earlier[-1]}" if earlier else f"no earlier complete iteration in {root}")
    return f"the checkpoint of iteration {iteration} is incomplete: {problem}; {hint}"
