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
import sys
from pathlib import Path
from typing import List, Optional, Sequence

from megatron.cli import CommandLineParser
from megatron.loaded_model import (ModelError, ModelFailure, add_model_flags, build_model,
                                   collect_problem, model_flag_problems, model_processes,
                                   prepare_model, run_command)


GenerateError = ModelError
"""A problem the user can act on, found before decoding starts (exit 2); the message names
the file, line or flag (megatron/loaded_model.py's, for the model's flags)."""

GenerateFailure = ModelFailure
"""A problem found while running (exit 1): a checkpoint's tensors unreadable, the output
not writable."""


def build_parser() -> argparse.ArgumentParser:
    p = CommandLineParser(prog="python -m megatron.generate", job=True,
                          description="Generate text from one of our checkpoints.")
    io = p.add_argument_group("input and output")
    # --load, --input and --output are required: checked with every other problem (flag_problems)
    io.add_argument("--input", metavar="IN.jsonl", help="one JSON object a line (required)")
    io.add_argument("--input-key", default="text", help="the field holding the input text")
    io.add_argument("--output", metavar="OUT.jsonl", help="(required)")
    io.add_argument("--micro-batch-size", type=int, default=8, help="inputs decoded together")
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
    add_model_flags(p, io)
    return p


def flag_problems(args, world_size: int) -> List[str]:
    """Every problem of the flags alone, all at once."""
    from megatron.data.storage.paths import path_flag_problems

    out = [f"--{name} is required" for name in ("input", "output")
           if getattr(args, name) is None]
    out += path_flag_problems(vars(args), {"input": ("--input", ()),
                                           "output": ("--output", ())})
    if args.micro_batch_size < 1:
        out.append(f"--micro-batch-size must be at least 1, not {args.micro_batch_size}")
    out += decoding_settings(args).problems()
    out += model_flag_problems(args, world_size)
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

    from megatron.generation import SpecialTokens
    from megatron.generation.lockstep import Lockstep, decode, dummy_decoder, padded

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
        ids, mask = padded([tokenizer.encode(t, add_eos=True) for t in chunk], pad, device)
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
    texts = None
    if args.input is not None and Path(args.input).is_file():
        texts = collect_problem(problems, read_inputs, args.input, args.input_key)
    checkpoint, cut, prompt, tokenizer = prepare_model(args, problems, staged)
    return texts, checkpoint, cut, prompt, tokenizer


def run(args) -> int:
    from megatron.checkpoint.io.remote_tools import Staged

    with Staged() as staged:  # s3:// checkpoints' downloads, removed at the end
        return _decode(args, staged)


def _decode(args, staged) -> int:
    """Decode (`staged`: where s3:// checkpoints are downloaded: prepare)."""
    import torch.distributed as dist

    from megatron.initialize import distributed_env

    world_size = int(distributed_env(os.environ)["WORLD_SIZE"])  # torchrun's, or Slurm's
    texts, (folder, meta, config), cut, prompt, tokenizer = prepare(args, world_size, staged)
    with model_processes(args, world_size) as run:
        model = build_model(folder, meta, config, run.tp, run.device, run.dtype,
                            args.attention_backend, run.ep, prompt, cut)
        records = generate_all(args, model, tokenizer, texts, run.device, run.data,
                               run.ep.group if run.ep.size > 1 else None)
        if run.data[1] > 1:  # every data-parallel rank's outputs, in input order
            everyone = [None] * world_size
            dist.all_gather_object(everyone, records)
            records = sorted({r["index"]: r for rank in everyone for r in rank}.values(),
                             key=lambda r: r["index"])
        for record in records:
            del record["index"]
        if run.rank == 0:
            write_jsonl(args.output, records)
            print(f"wrote {args.output}: {len(records)} outputs", file=sys.stderr)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Exit status: 0 written, 2 refused before decoding, 1 failed while decoding or writing,
    130 interrupted (Ctrl-C, SIGTERM); the rank that speaks for the job says why, one line a
    problem, the others stay silent (loaded_model.run_command)."""
    args = build_parser().parse_args(argv)
    return run_command(lambda: run(args), "interrupted; no output was written")


if __name__ == "__main__":
    sys.exit(main())
