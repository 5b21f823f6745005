"""Checkpoints that are never half-written, and exact resume.

Layout of `--save DIR` (Megatron's tracker and names, defined in megatron/checkpoint/layout.py;
DeepSpeed's files inside):

    DIR/latest_checkpointed_iteration.txt   the iteration of the newest complete checkpoint
    DIR/latest                              the same tag, for DeepSpeed's own tools
    DIR/iter_0001000/                       DeepSpeed's engine checkpoint (model, ZeRO states)
        meta.json                           iteration, consumed samples, layout, LR schedule,
                                            resolved flags (plain JSON)
        rng/rank_00003.pt                   python, numpy, torch (+cuda) and TP-tracker states

A save (megatron/checkpoint/io/saver.py) writes `iter_N.tmp/`, flushes it to disk, renames it to
`iter_N`, and only then replaces the tracker file (itself written to a temporary name and
renamed). A process killed at any moment leaves the previous checkpoint and the tracker that
points to it intact; the stale `.tmp` folder is removed by the next save.

Loading checks the layout first: a checkpoint saved with other tensor, pipeline, data or
expert-parallel sizes or ZeRO stage is resharded as it is read (io/reshard.py; one with a tuned
prompt must match; DeepSpeed itself reads the weights alone of a ZeRO 0-2 checkpoint at another
data-parallel size). Otherwise the training step (training/step.py, which owns the engine) reads
its files, and our own state is restored from JSON and `weights_only` tensor files. This module
knows no engine and needs no model to check a folder.
"""

from __future__ import annotations

import os
import pickle
import random
import shutil
import zipfile
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron.tensor_parallel.random import get_cuda_rng_tracker
from megatron.failures import RunFailure
from megatron.config.lr_schedule import LRSchedule, resolve_with_checkpoint
from megatron.config.training import CheckpointConfig
from megatron.checkpoint import layout as folder_layout  # (`layout` is the parallel sizes')
from megatron.checkpoint.formats.deepspeed_files import CheckpointReadError
from megatron.checkpoint.formats.meta import read_meta
from megatron.checkpoint.io.completeness import incomplete
from megatron.checkpoint.io.remote import fetch_for_load, is_remote
from megatron.checkpoint.io.reshard import load_resharded, reshard_problems, reshardable

TEST_PAUSE_ENV = "MEGATRON_CHECKPOINT_TEST_PAUSE_S"
"""Tests only: "SECONDS" or "ITERATION:SECONDS" to sleep after the engine files of a save are
written and before the rename, so that a test can kill the process mid-save."""


def pause_for_tests(iteration: int) -> float:
    value = os.environ.get(TEST_PAUSE_ENV, "")
    if not value:
        return 0.0
    at, _, seconds = value.rpartition(":")
    return float(seconds) if not at or int(at) == iteration else 0.0


class CheckpointError(RunFailure):
    """A checkpoint that cannot be read or written (megatron/failures.py: raised alike
    on every rank unless `rank_local`)."""


tag_for = folder_layout.iteration_folder_name
"""The iteration folder's name (DeepSpeed's checkpoint tag): megatron/checkpoint/layout.py."""


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def rng_state(device_type: str) -> Dict[str, Any]:
    """This rank's generator states as tensors and plain values (loadable with weights_only)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(),
             "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
             "torch": torch.get_rng_state(),
             "tracker": get_cuda_rng_tracker().get_states()}
    if device_type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Dict[str, Any], device_type: str) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if device_type == "cuda":
        torch.cuda.set_rng_state(state["cuda"])


def layout(parallel, zero_stage: int) -> Dict[str, int]:
    """What a checkpoint's files depend on: the parallel sizes and the ZeRO stage (the
    expert-parallel size only where it is over 1)."""
    out = {"tensor_model_parallel_size": parallel.tensor_model_parallel_size,
           "pipeline_model_parallel_size": parallel.pipeline_model_parallel_size,
           "data_parallel_size": parallel.data_parallel_size, "zero_stage": zero_stage}
    expert = getattr(parallel, "expert_model_parallel_size", 1)
    if expert > 1:
        out["expert_model_parallel_size"] = expert
    return out


def checkpoint_flag_problems(values: Dict[str, Any]) -> List[str]:
    """The checkpoint flags (`vars(namespace)`): combinations and folders."""
    problems = []
    if values["save_interval"] is not None and values["save"] is None:
        problems.append("--save-interval needs --save (where to write)")
    if values["async_save"] and values["save"] is None:
        problems.append("--async-save needs --save")
    if values["keep_last"] is not None:
        if values["keep_last"] < 1:
            problems.append(f"--keep-last {values['keep_last']}: keep at least 1 checkpoint")
        if values["save"] is None:
            problems.append("--keep-last needs --save")
    if values["ckpt_step"] is not None and values["ckpt_step"] < 0:
        problems.append(f"--ckpt-step {values['ckpt_step']}: give an iteration (0 or more)")
    for flag in ("no_load_optim", "no_load_rng", "finetune", "ckpt_step"):
        if values[flag] and values["load"] is None:
            problems.append(f"--{flag.replace('_', '-')} needs --load")
    if values["lr_policy"] != "check" and values["load"] is None:
        problems.append("--use-new-lr / --use-checkpoint-lr-scheduler need --load")
    if values["finetune"] and values["lr_policy"] == "checkpoint":
        problems.append("--finetune starts the LR schedule fresh; --use-checkpoint-lr-scheduler "
                        "contradicts it")
    if values["detect_nan_layers"]:
        if not values["check_for_nan"]:
            problems.append("--detect-nan-layers reports when the NaN guard stops the run; "
                            "--no-check-for-nan-in-loss-and-grad turns that off")
        if values["pipeline_model_parallel_size"] > 1:
            problems.append("--detect-nan-layers is not available with "
                            "--pipeline-model-parallel-size > 1 (run the same weights and data "
                            "without a pipeline)")
    load, save = values["load"], values["save"]
    if load is not None and Path(load).exists() and not Path(load).is_dir():
        problems.append(f"--load {load} is a file; give the checkpoint folder")
    elif load is not None and (values["finetune"] or values.get("prompt_tune")) \
            and "://" not in load:  # (a URL is refused, by its scheme, with the path flags)
        problems += _start_problems(load, values["finetune"])
    if save is not None and Path(save).exists() and not Path(save).is_dir():
        problems.append(f"--save {save} is a file; give a folder")
    return problems


def _start_problems(load: str, finetune: bool) -> List[str]:
    """--finetune (or --prompt-tune) starts from --load's weights: a folder that is missing or
    holds no checkpoint would train from scratch (and tune a prompt on a random model)."""
    why = "--finetune starts from its weights" if finetune else \
        "--prompt-tune tunes a prompt for the model it holds"
    root = Path(load)
    if not root.exists():
        return [f"--load {load}: no such folder; {why}: give the folder of the checkpoint to "
                f"start from"]
    try:
        if read_tracker(root) is not None:
            return []
    except CheckpointError:
        return []  # a damaged tracker: reported by the checks at --load
    return [f"--load {load} holds no checkpoint ({folder_layout.TRACKER} is missing); "
            f"{why}: give the folder of the checkpoint to start from"]


def checkpoint_problems(load: str, now: Dict[str, int], weights_only: bool,
                        schedule: Optional[LRSchedule] = None, lr_policy: str = "check",
                        finetune: bool = False, load_rng: bool = True,
                        ckpt_step: Optional[int] = None, label: Optional[str] = None
                        ) -> List[str]:
    """A checkpoint in `load` that a run of layout `now` cannot read (a file it needs missing
    or cut short: io/completeness.py; another layout), or (given the flags' learning-rate
    `schedule`) a resume whose schedule the checkpoint contradicts under `lr_policy`; found
    before any process starts. Empty when the folder holds none yet. `ckpt_step`: the
    iteration to load instead of the tracker's (--ckpt-step); `load_rng`: the run restores the
    random generators' states (not --no-load-rng or --finetune); `label`: how the messages name
    the folder (default "--load LOAD")."""
    root, label = Path(load), label or f"--load {load}"
    try:
        iteration = load_iteration(root, ckpt_step)
        if iteration is None:
            return []
        problem = incomplete(root, iteration, not weights_only, load_rng and not finetune)
        if problem is not None:
            return [f"{label}: {problem}"]
        meta = read_meta(root / tag_for(iteration))
    except (CheckpointError, ValueError, KeyError) as e:
        return [f"{label}: {e}"]
    return meta_problems(meta, load, now, weights_only, schedule, lr_policy, finetune, label)


def meta_problems(meta: Dict[str, Any], load: str, now: Dict[str, int], weights_only: bool,
                  schedule: Optional[LRSchedule] = None, lr_policy: str = "check",
                  finetune: bool = False, label: Optional[str] = None) -> List[str]:
    """What the checkpoint of meta.json `meta` contradicts in a run of layout `now` (another
    layout it cannot be resharded from; a learning-rate schedule, under `lr_policy`): the part
    of checkpoint_problems that needs only meta.json (an s3:// --load's, before start)."""
    label = label or f"--load {load}"
    try:
        if meta.get("format") == "weights":
            problems = weights_checkpoint_problems(load, weights_only, "optimizer" in meta,
                                                   label)
        else:
            problems = layout_problems(meta["layout"], now, load, weights_only, label)
            if problems and reshardable(meta):  # read into this layout: io/reshard.py
                problems = reshard_problems(meta, weights_only, label)
        if problems or schedule is None or not resumes_schedule(meta, finetune):
            return problems
        resolve_with_checkpoint(schedule, meta["lr_schedule"], lr_policy)
        return []
    except (CheckpointError, ValueError, KeyError) as e:
        return [f"{label}: {e}"]


def load_iteration(root: Path, ckpt_step: Optional[int] = None) -> Optional[int]:
    """The iteration a run loads from `root`: `ckpt_step` (--ckpt-step) where given, else the
    tracker's; None when the folder holds no checkpoint yet.

    Raises:
        CheckpointError: --ckpt-step names an iteration `root` has no folder for (the message
            lists those it has), or the tracker names no iteration.
    """
    if ckpt_step is None:
        return read_tracker(root) if root.is_dir() else None
    if not (root / tag_for(ckpt_step)).is_dir():
        have = [n for n, _ in folder_layout.iteration_folders(root)] if root.is_dir() else []
        raise CheckpointError(f"--ckpt-step {ckpt_step}: no folder {tag_for(ckpt_step)}; the "
                              f"iterations saved there: "
                              f"{', '.join(map(str, have)) if have else 'none'}")
    return ckpt_step


def resumes_schedule(meta: Dict[str, Any], finetune: bool) -> bool:
    """Whether loading the checkpoint of `meta` resumes the run (iteration, samples, LR
    schedule) rather than starting afresh from its weights."""
    return not (finetune or (meta.get("format") == "weights" and "optimizer" not in meta))


def prune(root: Path, keep_last: int) -> List[Path]:
    """Remove all but the newest `keep_last` complete checkpoints of `root` (the tracker's is
    always kept; folders being written, `iter_N.tmp`, are never touched); returns the removed.
    Called after the tracker names the newest, so a crash mid-removal loses only old ones."""
    current = read_tracker(root)
    done = folder_layout.iteration_folders(root)
    removed = []
    for iteration, path in done[:max(len(done) - keep_last, 0)]:
        if iteration == current:
            continue
        # renamed first, so that a half-removed folder never looks like a checkpoint
        doomed = path.with_name(path.name + ".removing")
        os.replace(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        removed.append(path)
    # an earlier run's interrupted removal
    for stale in root.glob(f"{folder_layout.ITERATION_PREFIX}*.removing"):
        shutil.rmtree(stale, ignore_errors=True)
    return removed


def read_tracker(load_dir: Path) -> Optional[int]:
    """The newest complete checkpoint's iteration, or None when the folder has none.

    Raises:
        CheckpointError: a tracker that names no iteration (megatron/checkpoint/layout.py).
    """
    try:
        return folder_layout.read_tracker(load_dir)
    except folder_layout.TrackerError as e:
        raise CheckpointError(str(e)) from None


def weights_checkpoint_problems(load: str, weights_only: bool, with_optimizer: bool = False,
                                label: Optional[str] = None) -> List[str]:
    """A checkpoint of full tensors (data_tools/convert_checkpoint.py) loads into any layout:
    as weights only, or as a resume where it carries optimizer states. `label`: how the
    message names the folder (default "--load LOAD")."""
    if weights_only or with_optimizer:
        return []
    return [f"{label or f'--load {load}'} holds weights only (written by data_tools/convert_checkpoint.py): "
            f"start from it with --finetune (or --no-load-optim --no-load-rng)"]


def layout_problems(saved: Dict[str, int], now: Dict[str, int], load: str,
                    weights_only: bool, label: Optional[str] = None) -> List[str]:
    """Why a checkpoint in `load` saved with layout `saved` cannot be loaded by a run of layout
    `now` (empty: it can). `label`: how the message names the folder (default "--load LOAD");
    the command it suggests names it with the convert tool's --load."""
    changed = []
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                "expert_model_parallel_size"):
        if saved.get(key, 1) != now.get(key, 1):
            changed.append(f"--{key.replace('_', '-')} {saved.get(key, 1)} in the checkpoint, "
                           f"{now.get(key, 1)} now")
    reshard_free = weights_only and saved["zero_stage"] < 3 and now["zero_stage"] < 3
    if not reshard_free:
        for key, flag in (("data_parallel_size", "data-parallel size"),
                          ("zero_stage", "--zero-stage")):
            if saved[key] != now[key]:
                changed.append(f"{flag} {saved[key]} in the checkpoint, {now[key]} now")
    if not changed:
        return []
    hint = ""
    if not weights_only and saved["zero_stage"] < 3 and now["zero_stage"] < 3:
        hint = ("; the weights alone of a ZeRO 0-2 checkpoint load on another data-parallel "
                "size or stage with --no-load-optim")
    command = (f"python data_tools/convert_checkpoint.py --load {load} --to megatron OUT "
               f"--target-tensor-parallel-size {now['tensor_model_parallel_size']} "
               f"--target-pipeline-parallel-size {now['pipeline_model_parallel_size']}")
    experts = now.get("expert_model_parallel_size", 1)
    if experts > 1 or saved.get("expert_model_parallel_size", 1) > 1:
        command += f" --target-expert-parallel-size {experts}"
    return [f"{label or f'--load {load}'}: the checkpoint was saved with another layout "
            f"({'; '.join(changed)}){hint}; to go on in this layout, convert it: `{command}`, "
            f"then --load OUT (it carries the optimizer states: the run resumes where it "
            f"stopped)"]


def damaged_file(folder: Path) -> Optional[str]:
    """The first file of an iteration folder that is cut short or whose zip directory is
    damaged (what a killed writer or a full disk leaves), as a message naming it; None when all
    open. Reads only each file's directory at its end, not its data."""
    for path in sorted(folder.rglob("*.pt")):
        try:
            with zipfile.ZipFile(path) as archive:
                archive.infolist()
        except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
            return (f"{path}: truncated or damaged ({e}); the checkpoint cannot be loaded: "
                    f"load an earlier iteration (--ckpt-step N)")
    return None


def load_checkpoint(step, config: CheckpointConfig, layout_now: Dict[str, int],
                    device_type: str) -> Optional[Dict[str, Any]]:
    """Restore from config.load; returns the checkpoint's meta.json (None: nothing to load).

    step: the training step (`megatron.training.step.TrainStep`), which reads the engine's files.
    Raises:
        CheckpointError: a damaged checkpoint or one from another layout.
    """
    root = Path(config.load)
    if is_remote(config.load):  # this rank's files, into a local folder (remote.py)
        try:
            root = fetch_for_load(config, lambda meta: meta.get("format") != "weights" and bool(
                layout_problems(meta["layout"], layout_now, config.load, config.weights_only))
                and reshardable(meta))  # read into this layout: every saved rank's files
        except OSError as e:
            raise CheckpointError(f"--load {config.load}: {e}",
                                  rank_local=getattr(e, "rank_local", False)) from None
    iteration = load_iteration(root, config.ckpt_step)
    if iteration is None:
        return None
    try:
        meta = read_meta(root / tag_for(iteration))
    except CheckpointReadError as e:  # validate() found it first; the folder may have changed
        raise CheckpointError(str(e)) from None
    if meta.get("format") == "weights":  # converted: full tensors, any layout
        optimizer = meta.get("optimizer")
        problems = weights_checkpoint_problems(config.load, config.weights_only,
                                               optimizer is not None)
        if problems:
            raise CheckpointError(problems[0])
        with_states = optimizer is not None and not config.weights_only
        step.load_weights(root / tag_for(iteration),
                          optimizer_step=int(optimizer["step"]) if with_states else None)
        return meta
    problems = layout_problems(meta["layout"], layout_now, config.load, config.weights_only)
    resharded = bool(problems) and reshardable(meta)  # read into this layout: io/reshard.py
    if problems and not resharded:  # validate() finds these first; a checkpoint may have
        raise CheckpointError(problems[0])  # appeared since
    damaged = [None]
    if dist.get_rank() == 0:  # validate() checked too; the folder may have changed since
        damaged[0] = incomplete(root, iteration, not config.weights_only,
                                not (config.finetune or config.no_load_rng or resharded))
        damaged[0] = f"--load {config.load}: {damaged[0]}" if damaged[0] else \
            damaged_file(root / tag_for(iteration))
    dist.broadcast_object_list(damaged, src=0)
    if damaged[0] is not None:
        raise CheckpointError(damaged[0])
    if resharded:
        return load_resharded(step, root / tag_for(iteration), meta, layout_now,
                              config.weights_only)
    try:
        loaded = step.load(root, tag_for(iteration), weights_only=config.weights_only)
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CheckpointError(f"{root / tag_for(iteration)}: a file cannot be read ({first}); "
                              f"the checkpoint is damaged: load an earlier iteration",
                              rank_local=True) from None
    if not loaded:
        raise CheckpointError(f"DeepSpeed could not load {root / tag_for(iteration)}",
                              rank_local=True)
    if not (config.finetune or config.no_load_rng):
        rng_file = root / tag_for(iteration) / "rng" / f"rank_{dist.get_rank():05d}.pt"
        if not rng_file.is_file():
            raise CheckpointError(f"{rng_file} is missing; pass --no-load-rng to start the "
                                  f"random generators afresh", rank_local=True)
        set_rng_state(torch.load(rng_file, weights_only=True), device_type)
    return meta
