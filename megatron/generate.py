"""`python -m megatron.generate`: text from one of our checkpoints, with KV-cached decoding.

    python -m megatron.generate --load ckpt/ --tokenizer-model spm/t5.model \
        --input prompts.jsonl --input-key text --output out.jsonl [--num-beams 4 ...]
    torchrun --nproc-per-node 2 -m megatron.generate ... --tensor-model-parallel-size 2
    torchrun --nproc-per-node 2 -m megatron.generate ... --expert-model-parallel-size 2
    torchrun --nproc-per-node 4 -m megatron.generate ... --pipeline-model-parallel-size 2 \
        --tensor-model-parallel-size 2

Each input line is a JSON object; its `--input-key` string is tokenized as the `--to hf`
export's tokenizer does (our SentencePiece tokenizer, EOS appended) and batched with padding
(`--micro-batch-size`). Each output line holds `text` (the decoded output), `ids` (the generated
ids, up to and including EOS; the text leaves EOS and padding out and keeps sentinels) and,
with beams, `score`. Decoding: greedy, beam search, or sampling (megatron/generation/search.py),
up to `--max-new-tokens`, as one DecodingSettings (megatron/generation/settings.py) built from
the decoding flags and checked with the others. The checkpoint is read as full tensors and
split for this run's tensor-parallel size, whatever its own (a pipeline checkpoint's stages
joined). With `--pipeline-model-parallel-size` PP, each stage holds only
its part of the model, cut as training cuts it (`--pipeline-model-parallel-split-rank` as in
training), and reads only its tensors; the stages decode together
(megatron/generation/pipeline.py), every rank of a pipeline running the same search.
The processes are TP x PP x DP: the data-parallel ranks decode their own micro-batches
(round robin); with `--expert-model-parallel-size` EP (dividing DP) a rank holds E / EP
experts of each Mixture-of-Experts layer and its expert-parallel group decodes in lockstep
(megatron/generation/lockstep.py); rank 0 writes every input's output, in input order.
With a tuned prompt (megatron/generation/prompt.py): `--prompt-load P` puts the prompt of a
prompt-tuning run's --save on --load, its base (refused, naming both, on another); a
--prompt-train-model checkpoint decodes with the prompt it holds.
--load and --prompt-load also take s3://BUCKET/PREFIX: checked, then downloaded into the
staging folder (megatron/checkpoint/io/remote_tools.py) and removed at the end.
The output is written to a temporary name and renamed. Every problem found before decoding
(the flags, --input's lines, --load, the tokenizer) is listed at once, one line each, exit 2; a
checkpoint that fails while it is read, or an output that cannot be written, exit 1; Ctrl-C or
SIGTERM, one line and exit 130 (docs/troubleshooting.md, "Exit statuses"). Under a launcher, one
rank speaks for the job (megatron/cli.py).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import List, Optional, Sequence

from megatron.cli import EXIT_INTERRUPTED, EXIT_USAGE, CommandLineParser, folder_problems, \
    speak_for_the_job, startup_voice

EXIT_FAILURE = 1


class GenerateError(Exception):
    """A problem the user can act on, found before decoding starts (exit 2); the message names
    the file, line or flag."""


class GenerateFailure(GenerateError):
    """A problem found while running (exit 1): a checkpoint's tensors unreadable, the output
    not writable."""


class Interrupted(BaseException):
    """SIGTERM, raised in the main thread as Ctrl-C raises KeyboardInterrupt."""


def build_parser() -> argparse.ArgumentParser:
    p = CommandLineParser(prog="python -m megatron.generate", job=True,
                          description="Generate text from one of our checkpoints.")
    io = p.add_argument_group("input and output")
    # --load, --input and --output are required: checked with every other problem (flag_problems)
    io.add_argument("--load", metavar="CKPT",
                    help="the trainer's --save folder (or an iteration folder, or a weights "
                         "checkpoint written by data_tools/convert_checkpoint.py)")
    io.add_argument("--iteration", type=int, default=None,
                    help="the checkpoint to read (default: the tracker's)")
    io.add_argument("--tokenizer-model", default=None,
                    help="the run's SentencePiece model or CPM-2 vocab.txt (default: the one "
                         "the run recorded, if it still exists)")
    io.add_argument("--input", metavar="IN.jsonl", help="one JSON object a line (required)")
    io.add_argument("--input-key", default="text", help="the field holding the input text")
    io.add_argument("--output", metavar="OUT.jsonl", help="(required)")
    io.add_argument("--micro-batch-size", type=int, default=8, help="inputs decoded together")
    io.add_argument("--prompt-load", default=None, metavar="DIR",
                    help="decode with the prompt of a prompt-tuning run's --save (its latest "
                         "checkpoint) on --load, its base model (refused on another base); a "
                         "--prompt-train-model checkpoint decodes with its own prompt without "
                         "this flag")
    d = p.add_argument_group("decoding (as transformers' generate defines them)")
    d.add_argument("--max-new-tokens", type=int, default=64)
    d.add_argument("--num-beams", type=int, default=1)
    d.add_argument("--length-penalty", type=float, default=1.0)
    d.add_argument("--early-stopping", nargs="?", const="true", default="false",
                   choices=("true", "false", "never"),
                   help="beam search: stop when num_beams hypotheses ended (true), by "
                        "transformers' heuristic (false, the default) or never")
    d.add_argument("--no-repeat-ngram-size", type=int, default=0)
    d.add_argument("--do-sample", action="store_true", help="sample instead of greedy search")
    d.add_argument("--temperature", type=float, default=1.0)
    d.add_argument("--top-k", type=int, default=0, help="0: no top-k filter")
    d.add_argument("--top-p", type=float, default=1.0)
    d.add_argument("--seed", type=int, default=1234, help="of the sampling")
    r = p.add_argument_group("runtime")
    r.add_argument("--tensor-model-parallel-size", type=int, default=None,
                   help="default: the number of processes / the expert-parallel size / the "
                        "pipeline-parallel size")
    r.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="Mixture-of-Experts: each rank holds E / EP experts; EP divides the "
                        "data-parallel size (processes / (TP x PP)), whose ranks decode their "
                        "own micro-batches")
    r.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="cut the model into this many stages, each holding its part only "
                        "(a model too large for one device); processes = TP x PP x DP")
    r.add_argument("--pipeline-model-parallel-split-rank", type=int, default=None,
                   help="the encoder on stages below this rank, the decoder on the others "
                        "(default: stages cut by each layer's cost, as in training)")
    r.add_argument("--attention-backend", default="auto", choices=("auto", "sdpa", "eager"))
    r.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"),
                   help="the weights' dtype while decoding")
    from megatron.config.checkpoint_storage import add_tool_storage_args

    add_tool_storage_args(p, REMOTE_FLAGS, uploads=False)
    return p


REMOTE_FLAGS = "--load / --prompt-load"
"""The flags that take an s3:// checkpoint (downloaded into the staging folder first)."""


def flag_problems(args, world_size: int) -> List[str]:
    """Every problem of the flags alone, all at once."""
    from megatron.data.storage.paths import path_flag_problems

    out = [f"--{name} is required" for name in ("load", "input", "output")
           if getattr(args, name) is None]
    out += path_flag_problems(vars(args), {  # local but checkpoints (megatron/data/storage/
        "load": ("--load", ("s3",)), "tokenizer_model": ("--tokenizer-model", ()),  # paths.py)
        "input": ("--input", ()), "output": ("--output", ()),
        "prompt_load": ("--prompt-load", ("s3",))})
    if args.micro_batch_size < 1:
        out.append(f"--micro-batch-size must be at least 1, not {args.micro_batch_size}")
    out += decoding_settings(args).problems()
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
    if args.input is not None and not Path(args.input).is_file():
        out.append(f"--input {args.input}: no such file")
    out_dir = Path(args.output or ".").resolve().parent
    if args.output is not None and not out_dir.is_dir():
        out.append(f"--output {args.output}: its folder {out_dir} does not exist")
    return out


def decoding_settings(args):
    """The decoding settings of the flags (megatron/generation/settings.py), unchecked:
    `flag_problems` lists their problems with the others'."""
    from megatron.generation.settings import DecodingSettings

    return DecodingSettings.from_flags(vars(args))


def read_inputs(path: str, key: str) -> List[str]:
    """The `key` string of each line of the JSONL file `path` (blank lines are skipped).

    Raises:
        GenerateError: a line that is not a JSON object, or lacks a string under `key`.
    """
    from megatron.data.preprocess.jsonl import BadLine, read_fields

    try:
        texts = [text for (text,) in read_fields(path, (key,), ("--input-key",))]
    except BadLine as e:
        raise GenerateError(str(e)) from None
    except OSError as e:
        raise GenerateError(f"--input {path}: unreadable ({e.strerror})") from None
    return texts


def read_checkpoint(load: str, iteration: Optional[int], expert_parallel: int = 1):
    """(iteration folder, meta.json, model config) of the checkpoint to decode with.

    Raises:
        GenerateError: unreadable, or a model this command cannot run.
    """
    from megatron.checkpoint.formats.deepspeed import CheckpointReadError, find_iteration, \
        model_config, read_meta

    try:
        folder = find_iteration(Path(load), iteration)
        meta = read_meta(folder)
        config = model_config(meta, folder / "meta.json")
    except CheckpointReadError as e:
        raise GenerateError(f"--load: {e}") from None
    if expert_parallel > 1 and not config.is_moe:
        raise GenerateError(f"--expert-model-parallel-size {expert_parallel}: --load {load} "
                            "is a dense model (no experts)")
    if expert_parallel > 1 and config.num_experts % expert_parallel:
        raise GenerateError(f"--expert-model-parallel-size {expert_parallel} does not divide "
                            f"the {config.num_experts} experts of --load {load}")
    return folder, meta, config


def load_tokenizer(args, meta):
    from megatron.data.tokenizers.tokenizer import build_tokenizer, resolve_tokenizer

    path, kind = args.tokenizer_model, None
    if path is None:
        flags = meta.get("flags") or {}
        path, kind = flags.get("tokenizer_model"), flags.get("tokenizer_type")
        if not path or not Path(path).exists():
            raise GenerateError("--tokenizer-model is required: the checkpoint does not name "
                                "a tokenizer that exists here")
    try:
        return build_tokenizer(resolve_tokenizer(path, kind))
    except ValueError as e:
        raise GenerateError(str(e)) from None


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
        raise GenerateFailure(f"--load {folder}: {e}") from None


def decoding_prompt(args, folder, meta):
    """The tuned prompt to decode with (megatron/generation/prompt.py), or None.

    Raises:
        GenerateError: a prompt on another base, or a prompt alone as --load.
    """
    from megatron.generation.prompt import PromptLoadError, generation_prompt

    try:
        prompt = generation_prompt(args.load, folder, meta, args.prompt_load)
    except PromptLoadError as e:
        raise GenerateError(str(e)) from None
    return prompt


def pipeline_cut(config, args):
    """The stages of `config` as training cuts them (None without a pipeline).

    Raises:
        GenerateError: the model cannot be cut so (the flags named).
    """
    from megatron.pipeline.partition import cut_model, cut_problems

    pp, split = args.pipeline_model_parallel_size, args.pipeline_model_parallel_split_rank
    problems = cut_problems(config, pp, split)
    if problems:
        raise GenerateError(f"--load {args.load}: the model cannot be cut so: " +
                            "; ".join(problems))
    return cut_model(config, pp, split) if pp > 1 else None


def batches(texts: List[str], size: int):
    for start in range(0, len(texts), size):
        yield start, texts[start:start + size]


def generate_all(args, model, tokenizer, texts, device, data=(0, 1),
                 group=None) -> List[dict]:
    """One record per input: text, ids (and score with beams); with `data` = (data-parallel
    rank, size) this rank's micro-batches only (round robin), each record with its input's
    `index`. `group`: the expert-parallel group this rank decodes in lockstep with (None: no
    other rank; every rank of it runs the same number of micro-batches and steps). `model`: a
    T5Model, or this rank's PipelineStage (every rank of its pipeline decodes the same inputs)."""
    import torch

    from megatron.generation import SpecialTokens
    from megatron.generation.lockstep import Lockstep, decode, dummy_decoder

    settings, tokens = decoding_settings(args), SpecialTokens.of(tokenizer)
    pad, eos = tokens.pad, tokens.eos
    records = []
    chunks = list(batches(texts, args.micro_batch_size))
    rank, size = data
    for round_ in range(-(-len(chunks) // size)):
        if round_ * size + rank >= len(chunks):  # none left: a dummy one, for the all-to-alls
            if group is not None:
                Lockstep(dummy_decoder(model, eos, device), group, pad).drain()
            continue
        first, chunk = chunks[round_ * size + rank]
        encoded = [tokenizer.encode(t, add_eos=True) for t in chunk]
        length = max(len(e) for e in encoded)
        ids = torch.full((len(encoded), length), pad, dtype=torch.long)
        mask = torch.zeros(len(encoded), length, dtype=torch.long)
        for row, e in enumerate(encoded):
            ids[row, :len(e)] = torch.tensor(e)
            mask[row, :len(e)] = 1
        ids, mask = ids.to(device), mask.to(device)
        # each micro-batch samples from its own seed: the ids do not depend on the batching of
        # the micro-batches over data-parallel ranks
        found = decode(model, ids, mask, tokens, settings.reseeded(first), group)
        for index, hypothesis in enumerate(found, start=first):
            # EOS and padding left out of the text; sentinels (<extra_id_N>) kept, as a span
            # corruption target reads
            shown = [i for i in hypothesis.ids if i not in (eos, pad)]
            record = {"index": index, "text": tokenizer.decode(shown), "ids": hypothesis.ids}
            if hypothesis.score is not None:
                record["score"] = hypothesis.score
            records.append(record)
    return records


def write_jsonl(path: str, records: List[dict]) -> None:
    """Write to a temporary name beside `path`, then rename: never half-written, not even when
    interrupted.

    Raises:
        GenerateFailure: the file cannot be written.
    """
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise GenerateFailure(f"--output {path}: cannot write ({e.strerror})") from None
    except BaseException:  # Ctrl-C or SIGTERM (Interrupted) mid-write
        tmp.unlink(missing_ok=True)
        raise


def prepare(args, world_size: int, staged=None):
    """(texts, (folder, meta, config), cut, prompt, tokenizer): everything read and checked
    before any process group or model exists. An s3:// --load or --prompt-load is downloaded
    into `staged` (remote_tools.Staged) once every other problem is ruled out, and read there.

    Raises:
        GenerateError: listing every problem found (the flags', --input's, --load's, the
            tokenizer's), one a line.
        GenerateFailure: an s3:// checkpoint that could not be downloaded.
    """
    problems = flag_problems(args, world_size)
    args = _downloaded(args, problems, staged)
    load_problems = [] if args.load is None else folder_problems("--load", args.load)
    problems += load_problems
    if args.prompt_load is not None:
        problems += folder_problems("--prompt-load", args.prompt_load,
                                    "the prompt-tuning run's --save folder")
    texts = checkpoint = cut = prompt = tokenizer = None
    if args.input is not None and Path(args.input).is_file():
        texts = _collect(problems, read_inputs, args.input, args.input_key)
    if args.load is not None and not load_problems and "://" not in args.load:
        ep_size = max(args.expert_model_parallel_size, 1)
        checkpoint = _collect(problems, read_checkpoint, args.load, args.iteration, ep_size)
    if checkpoint is not None:
        folder, meta, config = checkpoint
        if args.pipeline_model_parallel_size >= 1:
            cut = _collect(problems, pipeline_cut, config, args)
        if args.prompt_load is None or os.path.isdir(args.prompt_load):
            prompt = _collect(problems, decoding_prompt, args, folder, meta)
    if checkpoint is not None or args.tokenizer_model is not None:
        tokenizer = _collect(problems, load_tokenizer, args,
                             checkpoint[1] if checkpoint is not None else {})
    if tokenizer is not None and checkpoint is not None \
            and tokenizer.vocab_size > checkpoint[2].vocab_size:
        problems.append(f"--tokenizer-model: {tokenizer.vocab_size} tokens, more than the "
                        f"model's vocab_size {checkpoint[2].vocab_size}: not this run's "
                        f"tokenizer")
    if problems:
        problems = [getattr(args, "shown", lambda text: text)(p) for p in problems]
        raise GenerateError("the command line cannot run:\n" +
                            "\n".join(f"  - {p}" for p in problems))
    return texts, checkpoint, cut, prompt, tokenizer


def _downloaded(args, problems: List[str], staged):
    """`args` with an s3:// --load or --prompt-load replaced by its download into `staged`
    (--load whole, --prompt-load's model file and meta.json), and `shown(text)` putting the URLs
    back into messages. The object-storage flags' problems are added to `problems`; where there
    are none so far, those found on the server (refused credentials, no checkpoint, a missing or
    short object: each naming the flag and the key), and nothing is downloaded where there are
    any.

    Raises:
        GenerateFailure: a download that failed (naming the key)."""
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
            raise GenerateFailure(f"--{dest.replace('_', '-')} {remote[dest]}: {e}") from None
        setattr(local, dest, str(root))
        names[str(root)] = remote[dest]

    def shown(text: str) -> str:
        for path, url in names.items():
            text = text.replace(path, url)
        return text

    local.shown = shown
    return local


def _collect(problems: List[str], read, *args):
    """read(*args), or None with its GenerateError's message added to `problems`."""
    try:
        return read(*args)
    except GenerateError as e:
        problems.append(str(e))
        return None


def run(args) -> int:
    from megatron.checkpoint.io.remote_tools import Staged

    with Staged() as staged:  # s3:// checkpoints' downloads, removed at the end
        return _decode(args, staged)


def _decode(args, staged) -> int:
    """Decode (`staged`: where s3:// checkpoints are downloaded: prepare)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from megatron import parallel_state
    from megatron.initialize import PortInUse, choose_device, distributed_env, launcher_of, \
        start_process_group
    from megatron.tensor_parallel.group import ExpertParallel, TensorParallel

    world_size = int(distributed_env(os.environ)["WORLD_SIZE"])  # torchrun's, or Slurm's
    texts, (folder, meta, config), cut, prompt, tokenizer = prepare(args, world_size, staged)
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
            raise GenerateError(str(e)) from None
        created = True
    try:
        if world_size > 1:
            parallel_state.initialize_model_parallel(tp_size, pp_size, ep_size)
        tp, ep = TensorParallel.of_this_process(), ExpertParallel.of_this_process()
        data = ((parallel_state.get_data_parallel_rank(),
                 parallel_state.get_data_parallel_world_size()) if world_size > 1 else (0, 1))
        device = torch.device(device_type, torch.cuda.current_device()) \
            if device_type == "cuda" else torch.device("cpu")
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16,
                 "fp16": torch.float16}[args.dtype]
        model = build_model(folder, meta, config, tp, device, dtype, args.attention_backend,
                            ep, prompt, cut)
        records = generate_all(args, model, tokenizer, texts, device, data,
                               ep.group if ep.size > 1 else None)
        if data[1] > 1:  # every data-parallel rank's outputs, in input order
            everyone = [None] * world_size
            dist.all_gather_object(everyone, records)
            records = sorted({r["index"]: r for rank in everyone for r in rank}.values(),
                             key=lambda r: r["index"])
        for record in records:
            del record["index"]
        if (dist.get_rank() if world_size > 1 else 0) == 0:
            write_jsonl(args.output, records)
            print(f"wrote {args.output}: {len(records)} outputs", file=sys.stderr)
    finally:
        if world_size > 1:
            parallel_state.destroy_model_parallel()
        if created:
            dist.destroy_process_group()
    return 0


def _on_sigterm(signum, frame):
    raise Interrupted()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Exit status: 0 written, 2 refused before decoding, 1 failed while decoding or writing,
    130 interrupted (Ctrl-C, SIGTERM); the rank that speaks for the job says why, one line a
    problem, the others stay silent."""
    args = build_parser().parse_args(argv)
    main_thread = threading.current_thread() is threading.main_thread()  # where handlers go
    old_term = signal.signal(signal.SIGTERM, _on_sigterm) if main_thread else None
    try:
        return run(args)
    except GenerateFailure as e:  # may be this rank's alone (its shard): it says so itself
        rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID"))
        where = f" (rank {rank})" if rank is not None and startup_voice(os.environ) != "" \
            else ""
        print(f"error{where}: {e}", file=sys.stderr, flush=True)
        return EXIT_FAILURE
    except GenerateError as e:  # found alike by every rank, before any process group
        speak_for_the_job([str(e)], os.environ)  # the others wait until it is said
        return EXIT_USAGE
    except (KeyboardInterrupt, Interrupted):
        _say("interrupted; no output was written")
        return EXIT_INTERRUPTED
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, old_term)


def _say(line: str) -> None:
    if startup_voice(os.environ) is not None:
        print(line, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
