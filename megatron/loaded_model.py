"""The model a command runs, read from one of our checkpoints at any layout
(`python -m megatron.generate`, `python -m megatron.evaluate`).

- `add_model_flags`: --load, --iteration, --tokenizer-model, --prompt-load, the parallel sizes
  (TP x PP x DP, EP dividing DP), attention backend, dtype and the object-storage flags;
- `model_flag_problems` and `prepare_model`: every problem of those flags and of what they name
  (the checkpoint, the tokenizer, the pipeline cut, the prompt), found before any process group
  exists, listed at once with the command's own (`ModelError`, exit 2); an s3:// checkpoint
  downloaded into a staging folder once nothing else is wrong;
- `model_processes`: the process group and the model-parallel groups for the run;
- `build_model`: this rank's part of the model (megatron/pipeline/builder.py), its tensor- and
  expert-parallel shard read as full tensors from any saved layout, a pipeline stage holding
  its part only (megatron/generation/stage.py).
"""

from __future__ import annotations

import argparse
import contextlib
import os
from pathlib import Path
from typing import Callable, Iterator, List, NamedTuple, Optional, Tuple

from megatron.cli import folder_problems


EXIT_FAILURE = 1


class ModelError(Exception):
    """A problem the user can act on, found before the model runs (exit 2); the message names
    the file, line or flag."""


class ModelFailure(ModelError):
    """A problem found while running (exit 1): a checkpoint's tensors unreadable, an output
    not writable."""


class Interrupted(BaseException):
    """SIGTERM, raised in the main thread as Ctrl-C raises KeyboardInterrupt."""


def _on_sigterm(signum, frame):
    raise Interrupted()


def run_command(run: Callable[[], int], interrupted: str) -> int:
    """`run()`'s exit status, or the command's for what it raised: 2 for a ModelError (found
    alike by every rank before any process group: the rank that speaks for the job says it, one
    line a problem, the others stay silent), 1 for a ModelFailure (maybe this rank's alone: it
    says so itself, naming its rank), 130 for Ctrl-C or SIGTERM (the line `interrupted`).
    SIGTERM raises Interrupted in the main thread while `run` runs."""
    import signal
    import sys
    import threading

    from megatron.cli import EXIT_INTERRUPTED, EXIT_USAGE, speak_for_the_job, startup_voice

    main_thread = threading.current_thread() is threading.main_thread()  # where handlers go
    old_term = signal.signal(signal.SIGTERM, _on_sigterm) if main_thread else None
    try:
        return run()
    except ModelFailure as e:
        rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID"))
        where = f" (rank {rank})" if rank is not None and startup_voice(os.environ) != "" \
            else ""
        print(f"error{where}: {e}", file=sys.stderr, flush=True)
        return EXIT_FAILURE
    except ModelError as e:
        speak_for_the_job([str(e)], os.environ)  # the others wait until it is said
        return EXIT_USAGE
    except (KeyboardInterrupt, Interrupted):
        if startup_voice(os.environ) is not None:
            print(interrupted, file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, old_term)


REMOTE_FLAGS = "--load / --prompt-load"
"""The flags that take an s3:// checkpoint (downloaded into the staging folder first)."""


def add_model_flags(p: argparse.ArgumentParser, io) -> None:
    """The flags of the model a command runs, read from one of our checkpoints at any layout:
    --load and its companions into the group `io`, the parallel sizes, attention backend and
    dtype into a group "runtime", the object-storage flags (`python -m megatron.generate` and
    `python -m megatron.evaluate`)."""
    io.add_argument("--load", metavar="CKPT",
                    help="the trainer's --save folder (or an iteration folder, or a weights "
                         "checkpoint written by data_tools/convert_checkpoint.py); required")
    io.add_argument("--iteration", type=int, default=None,
                    help="the checkpoint to read (default: the tracker's)")
    io.add_argument("--tokenizer-model", default=None,
                    help="the run's SentencePiece model or CPM-2 vocab.txt (default: the one "
                         "the run recorded, if it still exists)")
    io.add_argument("--prompt-load", default=None, metavar="DIR",
                    help="run with the prompt of a prompt-tuning run's --save (its latest "
                         "checkpoint) on --load, its base model (refused on another base); a "
                         "--prompt-train-model checkpoint runs with its own prompt without "
                         "this flag")
    r = p.add_argument_group("runtime")
    r.add_argument("--tensor-model-parallel-size", type=int, default=None,
                   help="default: the number of processes / the expert-parallel size / the "
                        "pipeline-parallel size")
    r.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="Mixture-of-Experts: each rank holds E / EP experts; EP divides the "
                        "data-parallel size (processes / (TP x PP)), whose ranks run their "
                        "own share of the inputs")
    r.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="cut the model into this many stages, each holding its part only "
                        "(a model too large for one device); processes = TP x PP x DP")
    r.add_argument("--pipeline-model-parallel-split-rank", type=int, default=None,
                   help="the encoder on stages below this rank, the decoder on the others "
                        "(default: stages cut by each layer's cost, as in training)")
    r.add_argument("--attention-backend", default="auto", choices=("auto", "sdpa", "eager"))
    r.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"),
                   help="the weights' dtype while running")
    from megatron.config.checkpoint_storage import add_tool_storage_args

    add_tool_storage_args(p, REMOTE_FLAGS, uploads=False)


def model_flag_problems(args, world_size: int) -> List[str]:
    """Every problem of the model's flags (`add_model_flags`') alone: --load required, the
    paths, the parallel sizes against the number of processes."""
    from megatron.data.storage.paths import path_flag_problems

    out = ["--load is required"] if args.load is None else []
    out += path_flag_problems(vars(args), {  # local but checkpoints (megatron/data/storage/
        "load": ("--load", ("s3",)), "tokenizer_model": ("--tokenizer-model", ()),  # paths.py)
        "prompt_load": ("--prompt-load", ("s3",))})
    pp, ep = args.pipeline_model_parallel_size, args.expert_model_parallel_size
    if pp < 1:
        out.append(f"--pipeline-model-parallel-size must be at least 1, not {pp}")
        pp = 1
    split = args.pipeline_model_parallel_split_rank
    if split is not None and pp == 1:
        out.append(f"--pipeline-model-parallel-split-rank {split} needs "
                   "--pipeline-model-parallel-size > 1")
    if ep < 1:
        out.append(f"--expert-model-parallel-size must be at least 1, not {ep}")
        ep = 1
    tp = args.tensor_model_parallel_size or max(1, world_size // (ep * pp))
    model_size = f"--tensor-model-parallel-size {tp}" + \
        (f" x --pipeline-model-parallel-size {pp}" if pp > 1 else "")
    if tp < 1 or world_size % (tp * pp):
        out.append(f"{model_size} does not divide the number of processes ({world_size})")
    elif (world_size // (tp * pp)) % ep:
        out.append(f"--expert-model-parallel-size {ep} does not divide the data-parallel size "
                   f"{world_size // (tp * pp)} (processes {world_size} / tensor-parallel size "
                   f"{tp}" + (f" / pipeline-parallel size {pp})" if pp > 1 else ")"))
    return out


def read_checkpoint(load: str, iteration: Optional[int], expert_parallel: int = 1):
    """(iteration folder, meta.json, model config) of the checkpoint to decode with.

    Raises:
        ModelError: unreadable, or a model this command cannot run.
    """
    from megatron.checkpoint.formats.deepspeed import CheckpointReadError, find_iteration, \
        model_config, read_meta

    try:
        folder = find_iteration(Path(load), iteration)
        meta = read_meta(folder)
        config = model_config(meta, folder / "meta.json")
    except CheckpointReadError as e:
        raise ModelError(f"--load: {e}") from None
    if expert_parallel > 1 and not config.is_moe:
        raise ModelError(f"--expert-model-parallel-size {expert_parallel}: --load {load} "
                            "is a dense model (no experts)")
    if expert_parallel > 1 and config.num_experts % expert_parallel:
        raise ModelError(f"--expert-model-parallel-size {expert_parallel} does not divide "
                            f"the {config.num_experts} experts of --load {load}")
    return folder, meta, config


def load_tokenizer(args, meta):
    from megatron.data.tokenizers.tokenizer import build_tokenizer, resolve_tokenizer

    path, kind = args.tokenizer_model, None
    if path is None:
        flags = meta.get("flags") or {}
        path, kind = flags.get("tokenizer_model"), flags.get("tokenizer_type")
        if not path or not Path(path).exists():
            raise ModelError("--tokenizer-model is required: the checkpoint does not name "
                                "a tokenizer that exists here")
    try:
        return build_tokenizer(resolve_tokenizer(path, kind))
    except ValueError as e:
        raise ModelError(str(e)) from None


def build_model(folder, meta, config, tp, device, dtype, backend, ep=None, prompt=None,
                cut=None):
    """The model of `config` (whole, or with `cut` this rank's pipeline stage:
    megatron/generation/stage.py), this rank's tensor-parallel shard of the checkpoint's
    weights and its expert-parallel share of the experts (`ep`; default all) (read as full
    tensors: any saved tensor- or expert-parallel size; a stage keeps its parts' only), in
    evaluation mode, built by megatron/pipeline/builder.py; with `prompt`
    (megatron/generation/prompt.py) the prompt attached (on stage 0)."""
    import itertools

    from megatron.checkpoint.formats.deepspeed import (CheckpointReadError, iter_full_tensors,
                                                       model_source)
    from megatron.generation.stage import build_stage, pipeline_of_this_process
    from megatron.model.prompt import PROMPT_PARAMETER
    from megatron.model.state_dict import StateDictError
    from megatron.pipeline.builder import model_from_tensors
    from megatron.tensor_parallel.group import ExpertParallel

    divisible = int((meta.get("model") or {}).get("make_vocab_size_divisible_by", 128))
    how = dict(make_vocab_size_divisible_by=divisible, backend=backend, tp=tp,
               ep=ep or ExpertParallel(), device=device, dtype=dtype,
               prompt_layout=None if prompt is None else prompt.layout)
    try:
        tensors = iter_full_tensors(folder, model_source(meta))
        if prompt is not None and prompt.weight is not None:  # --prompt-load's
            tensors = itertools.chain(tensors, [(PROMPT_PARAMETER, prompt.weight)])
        if cut is None:
            return model_from_tensors(config, tensors, **how)
        stage, ranks, group = pipeline_of_this_process()
        return build_stage(config, cut, stage, tensors, ranks=ranks, group=group, **how)
    except (CheckpointReadError, StateDictError) as e:
        raise ModelFailure(f"--load {folder}: {e}") from None


def decoding_prompt(args, folder, meta):
    """The tuned prompt to decode with (megatron/generation/prompt.py), or None.

    Raises:
        ModelError: a prompt on another base, or a prompt alone as --load.
    """
    from megatron.generation.prompt import PromptLoadError, generation_prompt

    try:
        prompt = generation_prompt(args.load, folder, meta, args.prompt_load)
    except PromptLoadError as e:
        raise ModelError(str(e)) from None
    return prompt


def pipeline_cut(config, args):
    """The stages of `config` as training cuts them (None without a pipeline).

    Raises:
        ModelError: the model cannot be cut so (the flags named).
    """
    from megatron.pipeline.partition import cut_model, cut_problems

    pp, split = args.pipeline_model_parallel_size, args.pipeline_model_parallel_split_rank
    problems = cut_problems(config, pp, split)
    if problems:
        raise ModelError(f"--load {args.load}: the model cannot be cut so: " +
                            "; ".join(problems))
    return cut_model(config, pp, split) if pp > 1 else None


def prepare_model(args, problems: List[str], staged):
    """((folder, meta, config), cut, prompt, tokenizer) of the model flags (`add_model_flags`),
    read and checked before any process group or model exists, after the command's own
    `problems` (its flags', `model_flag_problems` included): an s3:// --load or --prompt-load
    is downloaded into `staged` (remote_tools.Staged) once every other problem is ruled out,
    and read there.

    Raises:
        ModelError: listing every problem found (`problems`, --load's, the tokenizer's),
            one a line.
        ModelFailure: an s3:// checkpoint that could not be downloaded.
    """
    args = _downloaded(args, problems, staged)
    load_problems = [] if args.load is None else folder_problems("--load", args.load)
    problems += load_problems
    if args.prompt_load is not None:
        problems += folder_problems("--prompt-load", args.prompt_load,
                                    "the prompt-tuning run's --save folder")
    checkpoint = cut = prompt = tokenizer = None
    if args.load is not None and not load_problems and "://" not in args.load:
        ep_size = max(args.expert_model_parallel_size, 1)
        checkpoint = collect_problem(problems, read_checkpoint, args.load, args.iteration, ep_size)
    if checkpoint is not None:
        folder, meta, config = checkpoint
        if args.pipeline_model_parallel_size >= 1:
            cut = collect_problem(problems, pipeline_cut, config, args)
        if args.prompt_load is None or os.path.isdir(args.prompt_load):
            prompt = collect_problem(problems, decoding_prompt, args, folder, meta)
    if checkpoint is not None or args.tokenizer_model is not None:
        tokenizer = collect_problem(problems, load_tokenizer, args,
                             checkpoint[1] if checkpoint is not None else {})
    if tokenizer is not None and checkpoint is not None \
            and tokenizer.vocab_size > checkpoint[2].vocab_size:
        problems.append(f"--tokenizer-model: {tokenizer.vocab_size} tokens, more than the "
                        f"model's vocab_size {checkpoint[2].vocab_size}: not this run's "
                        f"tokenizer")
    if problems:
        problems = [getattr(args, "shown", lambda text: text)(p) for p in problems]
        raise ModelError("the command line cannot run:\n" +
                            "\n".join(f"  - {p}" for p in problems))
    return checkpoint, cut, prompt, tokenizer


def _downloaded(args, problems: List[str], staged):
    """`args` with an s3:// --load or --prompt-load replaced by its download into `staged`
    (--load whole, --prompt-load's model file and meta.json), and `shown(text)` putting the URLs
    back into messages. The object-storage flags' problems are added to `problems`; where there
    are none so far, those found on the server (refused credentials, no checkpoint, a missing or
    short object: each naming the flag and the key), and nothing is downloaded where there are
    any.

    Raises:
        ModelFailure: a download that failed (naming the key)."""
    from megatron.checkpoint.io.completeness import needed
    from megatron.checkpoint.io.remote_tools import find_checkpoint
    from megatron.config.checkpoint_storage import tool_storage_from_args
    from megatron.data.storage.object_storage import ObjectStorageError, is_remote

    remote = {dest: getattr(args, dest) for dest in ("load", "prompt_load")
              if is_remote(getattr(args, dest))}
    storage, found = tool_storage_from_args(vars(args), bool(remote), REMOTE_FLAGS)
    problems += found
    if not remote or problems:  # the flags first: nothing is asked of the server before
        return args
    checkpoints = {}
    for dest, url in remote.items():
        iteration, files = (args.iteration, None) if dest == "load" else \
            (None, lambda name: needed(name, False, False))  # the prompt's model file
        try:
            checkpoints[dest] = find_checkpoint(url, storage, iteration, files)
        except ObjectStorageError as e:
            problems.append(f"--{dest.replace('_', '-')} {url}: {e}")
    if problems:
        return args
    local, names = argparse.Namespace(**vars(args)), {}
    for dest, checkpoint in checkpoints.items():
        try:
            root = staged.download(checkpoint)
        except ObjectStorageError as e:
            raise ModelFailure(f"--{dest.replace('_', '-')} {remote[dest]}: {e}") from None
        setattr(local, dest, str(root))
        names[str(root)] = remote[dest]

    def shown(text: str) -> str:
        for path, url in names.items():
            text = text.replace(path, url)
        return text

    local.shown = shown
    return local


def collect_problem(problems: List[str], read, *args):
    """read(*args), or None with its ModelError's message added to `problems`."""
    try:
        return read(*args)
    except ModelError as e:
        problems.append(str(e))
        return None


class ModelProcesses(NamedTuple):
    """This process's place in a command's processes (`model_processes`)."""
    tp: object
    """megatron/tensor_parallel/group.py's TensorParallel of this process."""
    ep: object
    """... and its ExpertParallel."""
    data: Tuple[int, int]
    """(data-parallel rank, data-parallel size)."""
    rank: int
    """The global rank (0 alone)."""
    device: object
    dtype: object
    """--dtype's torch dtype."""


@contextlib.contextmanager
def model_processes(args, world_size: int) -> Iterator[ModelProcesses]:
    """The process group (under a launcher, unless one exists) and the model-parallel groups of
    the model flags' sizes (`add_model_flags`) for the block; both ended after it.

    Raises:
        ModelError: the rendezvous port is taken.
    """
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from megatron import parallel_state
    from megatron.initialize import PortInUse, choose_device, distributed_env, launcher_of, \
        start_process_group
    from megatron.tensor_parallel.group import ExpertParallel, TensorParallel

    ep_size, pp_size = args.expert_model_parallel_size, args.pipeline_model_parallel_size
    tp_size = args.tensor_model_parallel_size or world_size // (ep_size * pp_size)
    device_type, backend, _ = choose_device(None)
    created = False
    if world_size > 1 and not dist.is_initialized():
        launcher = launcher_of(os.environ)
        os.environ.update(distributed_env(os.environ))
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        try:
            start_process_group(backend, timedelta(minutes=30), launcher)  # torch's default
        except PortInUse as e:
            raise ModelError(str(e)) from None
        created = True
    try:
        if world_size > 1:
            parallel_state.initialize_model_parallel(tp_size, pp_size, ep_size)
        data = ((parallel_state.get_data_parallel_rank(),
                 parallel_state.get_data_parallel_world_size()) if world_size > 1 else (0, 1))
        device = torch.device(device_type, torch.cuda.current_device()) \
            if device_type == "cuda" else torch.device("cpu")
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16,
                 "fp16": torch.float16}[args.dtype]
        yield ModelProcesses(TensorParallel.of_this_process(), ExpertParallel.of_this_process(),
                             data, dist.get_rank() if world_size > 1 else 0, device, dtype)
    finally:
        if world_size > 1:
            parallel_state.destroy_model_parallel()
        if created:
            dist.destroy_process_group()
