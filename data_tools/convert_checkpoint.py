"""Convert checkpoints: ours <-> Hugging Face, ours -> one fp32 state dict, any layout -> any
layout (weights), dense -> Mixture-of-Experts (upcycling), and inspect. A thin command line over
megatron/checkpoint/; no process groups or GPUs: it runs on a login node, one tensor at a time.

    # a Hugging Face folder (config, safetensors, tokenizer) from any checkpoint of ours
    python data_tools/convert_checkpoint.py --load ckpt/run --to hf out/t5-hf \\
        [--iteration N] [--tokenizer-model spm.model] [--max-shard-size 5GB] [--dtype bf16]
    # start our trainer from Hugging Face weights (then: --load out/ckpt --finetune)
    python data_tools/convert_checkpoint.py --from hf google-t5-folder --to megatron out/ckpt \\
        --target-tensor-parallel-size 4 --target-pipeline-parallel-size 2
    # our checkpoint for another layout, with its optimizer states (then: --load out/ckpt-tp4
    # resumes the run; --weights-only leaves them out)
    python data_tools/convert_checkpoint.py --load ckpt/run --to megatron out/ckpt-tp4 \\
        --target-tensor-parallel-size 4
    # one consolidated fp32 state dict (safetensors, our names) from any layout and ZeRO stage
    python data_tools/convert_checkpoint.py --load ckpt/run --to fp32 out/fp32
    python data_tools/convert_checkpoint.py --inspect ckpt/run
    # Mixture-of-Experts: the experts resharded as TP and PP are, with the optimizer states
    # (then: --load out/ckpt-ep4 --expert-model-parallel-size 4)
    python data_tools/convert_checkpoint.py --load ckpt/moe --to megatron out/ckpt-ep4 \\
        --target-expert-parallel-size 4
    # ... as a SwitchTransformersForConditionalGeneration folder (switch routing, one wi; top-k,
    # BASE, expert bias or an evaluation capacity factor only with --allow-inexact-hf)
    python data_tools/convert_checkpoint.py --load ckpt/moe --to hf out/switch-hf
    # upcycle a dense checkpoint (ours or --from hf): each expert a copy of its block's
    # feed-forward, the routers zero; with top-k it computes the dense model at step 0
    # (then: --load out/moe --finetune --model-config out/moe/model_config.json)
    python data_tools/convert_checkpoint.py --load ckpt/dense --to megatron out/moe \\
        --num-experts 8 --moe-router-topk 2
    # a CPM-2 checkpoint (CPM-2-Pretrain / -Finetune, any model-parallel size), with the run's
    # --model-config (CPM-2's JSON or ours) and, for --to hf, its vocab.txt folder
    python data_tools/convert_checkpoint.py --from cpm2 cpm2-ckpt/ --model-config \
        enc_dec_xlarge_config.json --tokenizer-path bpe_cn/ --to hf out/cpm2-hf
    # CPM-2-MoE (its moe branch: training saves at any data x model parallel, or init_ckpt.py's
    # output) into ours at any EP x TP, and back into CPM-2-MoE's layout at model parallel P
    python data_tools/convert_checkpoint.py --from cpm2 cpm2-moe/ --model-config \
        enc_dec_xlarge_config.json --to megatron out/moe --target-expert-parallel-size 4
    python data_tools/convert_checkpoint.py --load out/moe --to cpm2 out/cpm2-moe \
        --target-tensor-parallel-size 8 [--dtype fp16]
    # CPM-2's init_ckpt.py: a dense CPM-2 upcycled to CPM-2-MoE (centroid gain 0.01 as theirs)
    python data_tools/convert_checkpoint.py --from cpm2 cpm2-ckpt/ --model-config \
        enc_dec_xlarge_config.json --num-experts 32 --moe-router-type cpm2 --to cpm2 \
        out/expert-32 --target-tensor-parallel-size 8 --dtype fp16

Weights come from the fp32 master copy where the checkpoint has one (ZeRO 1-3, bf16 and fp16
runs; fp16 without ZeRO gives its fp16 weights, with a warning); experts split over ranks are
read whole. `--to megatron` from one of our checkpoints carries Adam's states too, so that the
run resumes in the new layout (any TP, PP, EP, DP and ZeRO stage; an upcycled model is weights
only). Output is written to OUT.tmp and renamed; an existing OUT is refused without --force.
--load and --inspect take s3://BUCKET/PREFIX (downloaded whole first), and so does --to megatron
(uploaded, the tracker last): data_tools/convert_remote.py, docs/checkpoints.md.
Exit status: 0 done, 2 bad command line, 1 a checkpoint that cannot be read or written (one
message naming the file and the tensor).

(Slightly over 600 lines: the flag checks of every source and target format stay in one
`check` so that a command line gets all its problems at once; the formats themselves live in
megatron/checkpoint/formats/.)
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Tuple

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from megatron.cli import CommandLineParser, folder_problems  # noqa: E402 - after the path is set
from megatron.data.storage.paths import path_flag_problems, scheme_problems  # noqa: E402
from megatron.stdout import logs_to_stderr  # noqa: E402 - after the path is set
from data_tools import convert_remote  # noqa: E402
from data_tools.convert_tokenizers import (  # noqa: E402 - after the path is set
    cpm2_tokenizer_files,
    cpm2_vocab_export,
    tokenizer_of,
)

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def build_parser() -> argparse.ArgumentParser:
    p = CommandLineParser(prog="convert_checkpoint.py", description=__doc__.split("\n")[0],
                          formatter_class=argparse.RawDescriptionHelpFormatter,
                          epilog=__doc__.split("\n", 1)[1])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--load", metavar="CKPT", help="one of our checkpoint folders (the "
                        "trainer's --save; or a weights checkpoint this tool wrote)")
    source.add_argument("--from", dest="from_format", choices=("hf", "cpm2"),
                        help="the source's format when it is not ours")
    source.add_argument("--inspect", metavar="CKPT", help="describe a checkpoint and stop")
    p.add_argument("source_dir", nargs="?", metavar="DIR",
                   help="with --from: the folder (for cpm2 the --save folder of the run)")
    p.add_argument("--to", nargs=2, metavar=("FORMAT", "OUT"),
                   help="hf, megatron, fp32 or cpm2 (CPM-2-MoE's layout), and the output folder")
    p.add_argument("--iteration", type=int, default=None,
                   help="the checkpoint to read (default: the tracker's)")
    p.add_argument("--target-tensor-parallel-size", type=int, default=None,
                   help="--to megatron: default 1; --to cpm2: the model-parallel size (default "
                        "the CPM-2 source's, else 1)")
    p.add_argument("--target-pipeline-parallel-size", type=int, default=1)
    p.add_argument("--target-expert-parallel-size", type=int, default=1,
                   help="--to megatron: the expert-model-parallel size the checkpoint is for "
                        "(recorded and checked against the experts; the trainer's "
                        "--expert-model-parallel-size)")
    p.add_argument("--model-config", default=None, metavar="FILE",
                   help="--from cpm2: the run's model config (CPM-2's enc_dec JSON or ours); "
                        "CPM-2 checkpoints do not record it")
    p.add_argument("--tokenizer-path", "--vocab-file", dest="vocab", default=None,
                   metavar="PATH", help="--from cpm2: CPM-2's vocab.txt or the folder holding "
                   "it (--to hf copies it; its special ids go into the config)")
    p.add_argument("--tokenizer-model", default=None,
                   help="--to hf: the run's tokenizer, a SentencePiece model or CPM-2's vocab.txt "
                        "(or its folder) (default: the run's, from its flags)")
    p.add_argument("--max-shard-size", default="5GB", help="split weight files above this")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                   help="--to hf: the weights' dtype (default fp32); --to cpm2: default the "
                        "source's (CPM-2's runs saved fp16)")
    p.add_argument("--weights-only", action="store_true",
                   help="--to megatron: leave the optimizer states out (default: carried "
                        "where the source has them, so that --load resumes the run)")
    p.add_argument("--force", action="store_true", help="replace an existing OUT")
    p.add_argument("--allow-inexact-hf", action="store_true",
                   help="--to hf of a Mixture-of-Experts model that transformers' "
                        "SwitchTransformers computes differently (top-k or BASE routing, expert "
                        "bias, an evaluation capacity factor): write it anyway, the differences "
                        "in its README.md")
    moe = p.add_argument_group(
        "upcycling", "--to megatron from a dense model: a Mixture-of-Experts model whose experts "
        "are copies of each sparse block's feed-forward, its router zero (a weights checkpoint: "
        "start it with --finetune); the trainer's flags, which set the model config's fields")
    moe.add_argument("--num-experts", type=int, default=None,
                     help="experts per sparse feed-forward")
    moe.add_argument("--moe-router-type", choices=("switch", "topk", "base", "cpm2"),
                     default=None,
                     help="default: switch; topk with renormalised weights starts as exactly "
                          "the dense model; cpm2: CPM-2-MoE's BASE layer (its init_ckpt.py; "
                          "every block sparse, --to cpm2 writes its layout)")
    moe.add_argument("--moe-router-topk", type=int, default=None,
                     help="k of the topk router (implies --moe-router-type topk)")
    moe.add_argument("--moe-encoder-sparse-step", type=int, default=None,
                     help="sparse encoder blocks: i %% step == 1, every block with 1 (default)")
    moe.add_argument("--moe-decoder-sparse-step", type=int, default=None,
                     help="the same for the decoder")
    moe.add_argument("--moe-centroid-gain", type=float, default=None,
                     help="--moe-router-type cpm2: the gain of the orthogonal routing centroids "
                          "(default 0.01, init_ckpt.py's)")
    vocab = p.add_argument_group(
        "vocabulary extension", "--to megatron: CPM-2's bilingual stage, the checkpoint grown to "
        "a vocabulary that train_tokenizer.py --extend made from the run's "
        "(megatron/checkpoint/formats/vocab_extension.py)")
    vocab.add_argument("--extend-vocab", metavar="NEW_TOKENIZER", default=None,
                       help="the extended tokenizer (a SentencePiece .model, or CPM-2's vocab.txt "
                            "or its folder); the old one is --tokenizer-model (--tokenizer-path "
                            "with --from cpm2), else the run's, from its flags. Old tokens keep "
                            "their rows under their new ids; a new token starts from the row of "
                            "its longest old prefix, else of a random old token. Optimizer "
                            "states, where carried (the default, as for any --to megatron; "
                            "--weights-only drops them): kept for the old rows, zero (fresh) for "
                            "the new; the trainer's --finetune starts from the weights alone")
    vocab.add_argument("--extend-vocab-seed", type=int, default=None, metavar="SEED",
                       help="seed of the random old rows of new tokens without an old prefix "
                            "(default 1234)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    convert_remote.add_args(p)
    return p


class CommandLineError(ValueError):
    pass


PATH_FLAGS = {"load": ("--load", ("s3",)), "inspect": ("--inspect", ("s3",)),
              "source_dir": ("DIR", ()),
              "model_config": ("--model-config", ()), "vocab": ("--tokenizer-path", ()),
              "tokenizer_model": ("--tokenizer-model", ()),
              "extend_vocab": ("--extend-vocab", ())}
"""Every path flag: local paths only (megatron/data/storage/paths.py), but s3:// checkpoints
(data_tools/convert_remote.py)."""


def check(args) -> List[str]:
    problems = path_flag_problems(vars(args), PATH_FLAGS)
    if args.to is not None:
        problems += scheme_problems(f"--to {args.to[0]}", args.to[1],
                                    ("s3",) if args.to[0] == "megatron" else ())
    if problems:  # (a URL would be taken for a local path)
        return problems
    for flag, path in (("--load", args.load), ("--inspect", args.inspect),
                       (f"--from {args.from_format}", args.source_dir)):
        if path is not None:  # refused here, with the others: exit 2, not a read failure's 1
            problems += folder_problems(flag, path, "the checkpoint folder")
    if args.inspect is not None:
        if args.to is not None:
            problems.append("--inspect stops after describing; --to has no effect with it")
        return problems + convert_remote.problems(args, problems)
    if args.from_format == "hf" and args.source_dir is None:
        problems.append("--from hf needs the Hugging Face folder: --from hf DIR")
    if args.from_format == "cpm2":
        if args.source_dir is None:
            problems.append("--from cpm2 needs the checkpoint folder: --from cpm2 DIR")
        if args.model_config is None:
            problems.append("--from cpm2 needs --model-config FILE: CPM-2 checkpoints do not "
                            "record the model config; give the run's (CPM-2's enc_dec JSON or "
                            "ours)")
        elif not Path(args.model_config).is_file():
            problems.append(f"--model-config {args.model_config}: no such file")
        if args.tokenizer_model is not None:
            problems.append("--tokenizer-model: CPM-2 has no SentencePiece model; give its "
                            "vocab.txt with --tokenizer-path")
        if args.vocab is not None and not Path(args.vocab).exists():
            problems.append(f"--tokenizer-path {args.vocab}: no such file or folder")
    else:
        for flag, value in (("--model-config", args.model_config),
                            ("--tokenizer-path", args.vocab)):
            if value is not None:
                problems.append(f"{flag} has effect only with --from cpm2")
    if args.load is not None and args.source_dir is not None:
        problems.append(f"unexpected argument {args.source_dir!r} (--load takes the folder)")
    if args.to is None:
        problems.append("--to FORMAT OUT is required (hf, megatron or fp32)")
        return problems
    kind, out = args.to
    if kind not in ("hf", "megatron", "fp32", "cpm2"):
        problems.append(f"--to {kind}: not one of hf, megatron, fp32, cpm2")
    if args.target_tensor_parallel_size is None and kind != "cpm2":
        args.target_tensor_parallel_size = 1
    if args.from_format == "hf" and kind == "hf":
        problems.append("--from hf --to hf: nothing to convert")
    for flag in ("target_tensor_parallel_size", "target_pipeline_parallel_size",
                 "target_expert_parallel_size"):
        value = getattr(args, flag)
        if value is None:
            continue
        if value < 1:
            problems.append(f"--{flag.replace('_', '-')} must be >= 1")
        elif value != 1 and kind not in ("megatron", "cpm2" if "tensor" in flag else ""):
            problems.append(f"--{flag.replace('_', '-')} has effect only with --to megatron")
    if args.weights_only and kind != "megatron":
        problems.append("--weights-only has effect only with --to megatron")
    problems += _upcycle_problems(args, kind)
    if args.allow_inexact_hf and kind != "hf":
        problems.append("--allow-inexact-hf has effect only with --to hf")
    if args.dtype is not None and kind not in ("hf", "cpm2"):
        problems.append("--dtype has effect only with --to hf or --to cpm2")
    if args.tokenizer_model is not None and kind != "hf" and args.extend_vocab is None:
        problems.append("--tokenizer-model has effect only with --to hf")
    problems += _extend_vocab_problems(args, kind)
    if args.tokenizer_model is not None and not Path(args.tokenizer_model).exists():
        problems.append(f"--tokenizer-model {args.tokenizer_model}: no such file")
    if args.iteration is not None and args.load is None and args.from_format != "cpm2":
        problems.append("--iteration needs --load (or --from cpm2)")
    if Path(out).exists() and not args.force:
        problems.append(f"{out} exists; pass --force to replace it")
    return problems + convert_remote.problems(args, problems)


def _extend_vocab_problems(args, kind: str) -> List[str]:
    if args.extend_vocab is None:
        return ["--extend-vocab-seed needs --extend-vocab"] \
            if args.extend_vocab_seed is not None else []
    problems = []
    if kind != "megatron":
        problems.append("--extend-vocab has effect only with --to megatron")
    if args.num_experts is not None:
        problems.append("--extend-vocab with --num-experts: upcycle and extend in two conversions")
    if not Path(args.extend_vocab).exists():
        problems.append(f"--extend-vocab {args.extend_vocab}: no such file or folder")
    return problems


def vocab_extended(args, model_meta: dict, tensors, source: dict):
    """(model meta, tensors, source, row plan) grown to --extend-vocab's vocabulary
    (megatron/checkpoint/formats/vocab_extension.py)."""
    from megatron.checkpoint.formats import vocab_extension as ve
    from megatron.data.tokenizers.extend import DEFAULT_SEED, row_sources
    from megatron.data.tokenizers.tokenizer import build_tokenizer, resolve_tokenizer

    if source.get("format") == "cpm2" and args.vocab is not None:
        old_spec = resolve_tokenizer(args.vocab, path_flag="--tokenizer-path")
    else:
        folder = Path(source["path"]) if source.get("format") == "megatron" else None
        old_spec = tokenizer_of(args, folder)
    if old_spec is None:
        raise CommandLineError("--extend-vocab needs the checkpoint's own tokenizer: give it "
                               "with --tokenizer-model (--tokenizer-path with --from cpm2)")
    new_spec = resolve_tokenizer(args.extend_vocab, path_flag="--extend-vocab")
    seed = DEFAULT_SEED if args.extend_vocab_seed is None else args.extend_vocab_seed
    plan = row_sources(build_tokenizer(old_spec), build_tokenizer(new_spec), seed,
                       old_name=old_spec.path, new_name=new_spec.path)
    refused = ve.adds_nothing(plan, new_spec.path, old_spec.path)
    if refused is not None:
        raise CommandLineError(refused)
    config = ve.extended_config(model_meta["config"], plan)
    counts = ve.summary(plan)
    print(f"vocabulary: {plan.old_size} ids ({old_spec.path}) -> {plan.new_size} "
          f"({new_spec.path}): {counts['old']} old rows moved with their ids, {counts['prefix']} "
          f"new from their longest old prefix, {counts['random']} from a random old token "
          f"(seed {seed}); model vocab_size {model_meta['config']['vocab_size']} -> "
          f"{config['vocab_size']}")
    source = {**source, "vocab_extended": {"old_tokenizer": str(old_spec.path),
                                           "new_tokenizer": str(new_spec.path),
                                           "seed": seed, "rows": counts}}
    return {**model_meta, "config": config}, ve.extended_tensors(tensors, plan), source, plan


def _upcycle_flags(args) -> dict:
    from megatron.checkpoint.formats.upcycle import UPCYCLE_FLAGS

    return {field: getattr(args, flag[2:].replace("-", "_"))
            for flag, field in UPCYCLE_FLAGS.items()}


def _upcycle_problems(args, kind: str) -> List[str]:
    given = {k: v for k, v in _upcycle_flags(args).items() if v is not None}
    if args.moe_centroid_gain is not None and given.get("router_type") != "cpm2":
        return ["--moe-centroid-gain needs --num-experts and --moe-router-type cpm2"]
    if args.moe_centroid_gain is not None and args.moe_centroid_gain <= 0:
        return ["--moe-centroid-gain must be > 0"]
    if not given:
        return []
    if "num_experts" not in given:
        return ["--moe-* flags upcycle a dense model: they need --num-experts"]
    problems = []
    if kind not in ("megatron", "cpm2"):
        problems.append("--num-experts (upcycling) has effect only with --to megatron or cpm2")
    if kind == "cpm2" and given.get("router_type") != "cpm2":
        problems.append("--to cpm2 with --num-experts needs --moe-router-type cpm2")
    if given["num_experts"] < 1:
        problems.append("--num-experts must be >= 1")
    return problems


def _progress(enabled: bool, total: int, what: str):
    if not enabled:
        return lambda name: None
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is a dependency; without it, no bar
        return lambda name: None
    bar = tqdm(total=total, desc=what, unit="tensor", file=sys.stderr)
    return lambda name: bar.update(1)


def read_source(args) -> Tuple[dict, Iterator, dict, int]:
    """(model meta, iterator of full tensors under our names, source description, tensor
    count)."""
    if args.from_format == "cpm2":
        from megatron.checkpoint.formats.cpm2 import read_cpm2_checkpoint

        config, tensors, source, notes = read_cpm2_checkpoint(
            args.source_dir, args.model_config, args.iteration, args.vocab)
        for note in notes:
            print(f"warning: {note}", file=sys.stderr)
        meta = {"config": config.to_dict(), "make_vocab_size_divisible_by": 128,
                "precision": "fp32"}
        return meta, tensors, source, _count(meta)
    if args.from_format == "hf":
        from megatron.checkpoint.formats.hf import read_hf_folder

        config, tensors = read_hf_folder(args.source_dir)
        meta = {"config": config.to_dict(), "make_vocab_size_divisible_by": 128,
                "precision": "fp32"}
        return meta, tensors, {"format": "hf", "path": str(Path(args.source_dir).resolve())}, \
            _count(meta)
    from megatron.checkpoint.formats import deepspeed as ours

    folder = ours.find_iteration(Path(args.load), args.iteration)
    meta = ours.read_meta(folder)
    source = {"format": "megatron", "path": str(folder.resolve()),
              "iteration": meta.get("iteration"), "layout": meta.get("layout")}
    model = dict(meta["model"]) if "model" in meta else \
        {"config": ours.model_config(meta).to_dict()}
    kind = "master"
    if (meta.get("layout") or {}).get("zero_stage") == 0 and model.get("precision") == "fp16":
        print("warning: fp16 without ZeRO keeps its fp32 masters inside DeepSpeed's fp16 "
              "optimizer, without parameter names: reading the fp16 weights", file=sys.stderr)
        kind = "weights"
    return model, ours.iter_full_tensors(folder, kind), source, _count(model)


def _count(model_meta: dict) -> int:
    """The tensors a model has under our names (the progress bar's total)."""
    from megatron.model.config import T5Config
    from megatron.model.meta import buffer_shapes, parameter_splits

    config = T5Config.from_dict(model_meta["config"], source="the checkpoint's meta.json")
    return len(parameter_splits(config)) + len(buffer_shapes(config))


def optimizer_states(args, source: dict):
    """What write_weights_checkpoint takes to carry the source's optimizer states, or None (with
    a warning saying why) where they cannot be carried."""
    if args.load is None or args.weights_only:
        return None
    from megatron.checkpoint.formats import deepspeed as ours

    folder = Path(source["path"])
    try:
        step = ours.check_optimizer_states(folder)
    except ours.CheckpointReadError as e:
        print(f"warning: the optimizer states cannot be carried ({e}); writing weights only",
              file=sys.stderr)
        return None
    meta = ours.read_meta(folder)
    return {"step": step, "exp_avg": ours.iter_full_tensors(folder, "exp_avg"),
            "exp_avg_sq": ours.iter_full_tensors(folder, "exp_avg_sq"),
            "resume": {k: meta.get(k) for k in ("consumed_samples", "lr_schedule")}}


def upcycled(args, model_meta: dict, tensors, source: dict):
    """(model meta, tensors, source) of the Mixture-of-Experts model --num-experts asks for, made
    from the dense source (megatron/checkpoint/formats/upcycle.py)."""
    from megatron.checkpoint.formats.upcycle import UpcycleError, upcycle, upcycled_config
    from megatron.model.config import T5Config

    dense = T5Config.from_dict(model_meta["config"], source="the source's config")
    try:
        config = upcycled_config(dense, {**_upcycle_flags(args),
                                         "router_centroid_gain": args.moe_centroid_gain})
    except UpcycleError as e:
        raise CommandLineError(str(e)) from None
    router = f"CPM-2's orthogonal centroids (gain {config.router_centroid_gain})" \
        if config.router_type == "cpm2" else "zero"
    source = {**source, "upcycled": {"num_experts": config.num_experts,
                                     "router_type": config.router_type,
                                     "experts_per_token": config.router_k,
                                     "router": router}}
    return {**model_meta, "config": config.to_dict()}, \
        upcycle(tensors, config), source


def to_megatron(args, out: Path, model_meta: dict, tensors, source: dict, progress,
                optimizer) -> int:
    from megatron.checkpoint.formats.weights import write_weights_checkpoint
    from megatron.model.config import T5Config

    experts = args.target_expert_parallel_size
    num_experts = T5Config.from_dict(model_meta["config"]).num_experts
    if experts > 1 and (num_experts == 0 or num_experts % experts):
        raise CommandLineError(f"--target-expert-parallel-size {experts}: the model has "
                               f"{num_experts} experts, which it does not divide")
    layout = {"tensor_model_parallel_size": args.target_tensor_parallel_size,
              "pipeline_model_parallel_size": args.target_pipeline_parallel_size}
    if experts > 1:
        layout["expert_model_parallel_size"] = experts
    write_weights_checkpoint(out, tensors, model_meta, iteration=source.get("iteration") or 0,
                             source=source, target_layout=layout,
                             max_shard_size=args.max_shard_size, force=args.force,
                             progress=progress, optimizer=optimizer)
    (out / "model_config.json").write_text(json.dumps(model_meta["config"], indent=1))
    config = f"--model-config {out / 'model_config.json'}"
    sizes = "tensor, pipeline, expert and data-parallel size" if num_experts \
        else "tensor, pipeline and data-parallel size"
    if optimizer is not None:
        print(f"wrote {out} with the optimizer states (Adam step {optimizer['step']}): resume "
              f"with --load {out} at iteration {source.get('iteration')}, in any {sizes} and "
              f"ZeRO stage ({config}); or start from its weights with --finetune")
    else:
        upcycle = source.get("upcycled")
        what = (f" (upcycled: {num_experts} experts, each a copy of its block's feed-forward, "
                f"the routers {upcycle['router']}; see megatron/checkpoint/formats/upcycle.py "
                f"for what it computes at step 0)") if upcycle else ""
        print(f"wrote {out}{what}: start the trainer with --load {out} --finetune (any {sizes}; "
              f"{config}); the optimizer starts fresh")
    return 0


def to_cpm2(args, out: Path, model_meta: dict, tensors, source: dict, progress) -> int:
    """CPM-2-MoE's layout (megatron/checkpoint/formats/cpm2_moe.py): its training save, or
    init_ckpt.py's where the source was (or was upcycled to be) that."""
    import torch

    from megatron.checkpoint.formats.cpm2_moe import check_writable, write_cpm2_moe_checkpoint
    from megatron.model.config import T5Config

    config = T5Config.from_dict(model_meta["config"], source="the source's config")
    size = args.target_tensor_parallel_size or source.get("model_parallel_size") or 1
    layout = "init" if "upcycled" in source else source.get("cpm2_layout", "save")
    try:
        check_writable(config, size, layout)
    except ValueError as e:
        raise CommandLineError(str(e)) from None
    dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype is not None else None

    def counted():
        for name, tensor in tensors:
            progress(name)
            yield name, tensor

    iteration = source.get("iteration") or 0
    files = write_cpm2_moe_checkpoint(out, counted(), config, iteration, size, layout=layout,
                                      dtype=dtype, force=args.force)
    shape = (f"{config.num_experts} data-parallel ranks (one expert each) x {size} "
             f"model-parallel ranks" if layout == "save" else
             f"{size} model-parallel ranks, init_ckpt.py's layout (every data rank loads them)")
    print(f"wrote {out}: CPM-2-MoE at iteration {iteration}, {len(files)} files for {shape}")
    return 0


def run(args, staged=None) -> int:
    """The conversion (or --inspect) of a checked command line; `staged`: the folders of an
    s3:// --to megatron output (convert_remote)."""
    if args.inspect is not None:
        from megatron.checkpoint.formats.deepspeed import describe, find_iteration

        with logs_to_stderr():  # stdout holds the JSON alone
            info = describe(find_iteration(Path(args.inspect), args.iteration))
        print(convert_remote.shown_text(args, json.dumps(info, indent=1, sort_keys=True,
                                                         default=str)))
        return 0
    kind, out = args.to[0], Path(args.to[1])
    model_meta, tensors, source, total = read_source(args)
    if args.num_experts is not None:  # upcycling: weights only
        model_meta, tensors, source = upcycled(args, model_meta, tensors, source)
        total = _count(model_meta)
    plan = None
    if args.extend_vocab is not None:
        model_meta, tensors, source, plan = vocab_extended(args, model_meta, tensors, source)
    optimizer = optimizer_states(args, source) \
        if kind == "megatron" and "upcycled" not in source else None
    if optimizer is not None and plan is not None:
        from megatron.checkpoint.formats.vocab_extension import extended_tensors

        for key in ("exp_avg", "exp_avg_sq"):
            optimizer[key] = extended_tensors(optimizer[key], plan, zero_new_rows=True)
    if optimizer is not None:
        total *= 3  # the weights, then each moment
    shown = convert_remote.shown_source(args, source)  # an s3:// source by its URL
    progress = _progress(not args.no_progress, total, f"--to {kind}")
    if kind == "megatron" and convert_remote.output_is_remote(args):
        return convert_remote.to_remote_megatron(args, staged, lambda local: to_megatron(
            args, local, model_meta, tensors, shown, progress, optimizer))
    if kind == "megatron":
        return to_megatron(args, out, model_meta, tensors, shown, progress, optimizer)
    if kind == "cpm2":
        return to_cpm2(args, out, model_meta, tensors, source, progress)
    if kind == "fp32":
        import torch

        from megatron.checkpoint.formats.weights import write_weights_checkpoint

        fp32 = ((name, t.to(torch.float32)) for name, t in tensors)
        write_weights_checkpoint(out, fp32, model_meta, iteration=source.get("iteration") or 0,
                                 source=shown, max_shard_size=args.max_shard_size,
                                 force=args.force, progress=progress)
        print(f"wrote {out}: full fp32 tensors under our names (safetensors in "
              f"{out}/iter_*/); it also loads into the trainer with --finetune")
        return 0
    from megatron.checkpoint.formats.hf import write_hf_folder
    from megatron.model.config import T5Config

    config = T5Config.from_dict(model_meta["config"], source="the checkpoint's meta.json")
    folder = Path(source["path"]) if source.get("format") == "megatron" else None
    tokenizer, tokenizer_files = None, None
    if source.get("format") == "cpm2":
        tokenizer_files = cpm2_tokenizer_files(args, config, source)
    else:
        spec = tokenizer_of(args, folder)
        if spec is None:
            print("warning: no tokenizer (give --tokenizer-model): the folder has weights and "
                  "config only", file=sys.stderr)
        elif spec.tokenizer_type == "CPM2Tokenizer":
            config, tokenizer_files = cpm2_vocab_export(config, spec, source)
        else:
            tokenizer = spec.path
    import torch

    dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype is not None else \
        (torch.float32 if source.get("format") == "cpm2" else None)  # CPM-2 saved fp16
    write_hf_folder(out, config, tensors, max_shard_size=args.max_shard_size,
                    tokenizer_model=tokenizer, dtype=dtype, force=args.force,
                    progress=progress, tokenizer_files=tokenizer_files,
                    allow_inexact=args.allow_inexact_hf)
    tokenizer_note = "; tokenizer: see its README.md" if tokenizer_files is not None else ""
    kind = "SwitchTransformersForConditionalGeneration" if config.is_moe \
        else "T5ForConditionalGeneration"
    print(f"wrote {out}: {kind}.from_pretrained({str(out)!r}){tokenizer_note}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    problems = check(args)
    if problems:
        print("error: the command line cannot run:\n" + "\n".join(f"  - {p}" for p in problems),
              file=sys.stderr)
        return 2
    try:
        # DeepSpeed logs its accelerator choice on import, to stdout: keep stdout for our output
        # (its logger then writes to stderr for the rest of the run)
        with logs_to_stderr():
            importlib.import_module("deepspeed")
        with convert_remote.staging() as staged:  # s3:// checkpoints go through it
            return run(convert_remote.localized(args, staged), staged)
    except CommandLineError as e:  # found once the source is read
        print(f"error: the command line cannot run: {e}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:  # our readers' errors name the file and the tensor
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
