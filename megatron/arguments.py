"""Every command-line flag of `megatron.pretrain_t5`, under Megatron-LM and CPM-2 names.

`parse_args(argv, env)` parses, then `validate` resolves what follows from the flags (world and
data-parallel size, batch sizes, precision, the model config, the DeepSpeed config) and lists every
problem at once, before any process group is created or any data is read. Flags that have no
effect in some combination are refused, never silently ignored.

Flags that DeepSpeed's JSON may also set (batch sizes, clipping, precision, loss scaling, the
optimizer's hyperparameters, the ZeRO stage and offload) default to None here, so that "not
given" can be told from "given as the default": a value given on both sides must agree; a value
given on one side is taken by the other.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence

from megatron.data.data_args import add_data_args, check_data_args, t5_config_from_args
from megatron.data.builder import parse_data_path
from megatron.training.lr_schedule import DECAY_STYLES

DEFAULTS = dict(clip_grad=1.0, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.999,
                adam_eps=1e-8, initial_loss_scale=2.0 ** 32, zero_stage=0,
                offload_optimizer="none", offload_param="none")
"""Defaults of the flags that the DeepSpeed JSON may also set (applied after the cross-check)."""


class ArgumentsError(ValueError):
    """The command line (with its files) cannot run; `problems` lists every reason."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(f"  - {p}" for p in self.problems))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m megatron.pretrain_t5", allow_abbrev=False,
        description="Pretrain a T5 / CPM-2 encoder-decoder with DeepSpeed and tensor parallelism.")
    add_data_args(parser, schedule=False)
    for action in parser._actions:  # checked in validate(), with every other problem
        action.required = False

    g = parser.add_argument_group("model")
    g.add_argument("--model-config", help="model JSON (Hugging Face T5 config.json or CPM-2's "
                   "enc_dec config) or a preset name from configs/model (e.g. t5-base)")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the embedding to a multiple of this x tensor-parallel size")
    g.add_argument("--attention-backend", choices=("auto", "sdpa", "eager"), default="auto",
                   help="attention kernel: auto picks sdpa on CUDA and for cross-attention")
    g.add_argument("--label-smoothing", type=float, default=0.0,
                   help="of the cross entropy, in [0, 1)")
    g.add_argument("--checkpoint-activations", dest="checkpoint_activations",
                   action="store_true",
                   help="recompute transformer blocks in backward (saves activation memory)")
    g.add_argument("--checkpoint-num-layers", type=int, default=1,
                   help="blocks per recomputed chunk")
    g.add_argument("--deepspeed-activation-checkpointing", action="store_true",
                   help="CPM-2 / Megatron-DeepSpeed spelling: turns on --checkpoint-activations "
                        "and checks the DeepSpeed JSON's 'activation_checkpointing' section "
                        "(options our recomputation does not implement are refused)")

    g = parser.add_argument_group("parallelism and launch")
    g.add_argument("--tensor-model-parallel-size", "--model-parallel-size",
                   dest="tensor_model_parallel_size", type=int, default=1,
                   help="split attention heads, d_ff and the vocabulary over this many ranks")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="only 1: pipeline parallelism is not available yet")
    g.add_argument("--distributed-backend", choices=("nccl", "gloo"), default=None,
                   help="default: nccl with CUDA, gloo on CPU; nccl without CUDA falls back to "
                        "gloo with a warning")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                   help="how long a collective (and a training step) may wait before the job "
                        "fails")
    g.add_argument("--data-timeout-minutes", type=float, default=10.0,
                   help="how long a rank may wait for one batch from the data loader")
    g.add_argument("--checkpoint-timeout-minutes", type=float, default=30.0,
                   help="how long saving or loading a checkpoint may take")
    g.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int, default=None,
                   help="set by torch.distributed.launch and the deepspeed launcher; LOCAL_RANK "
                        "in the environment is used otherwise")
    g.add_argument("--num-workers", type=int, default=1, help="data-loader worker processes")

    g = parser.add_argument_group("batch and schedule")
    g.add_argument("--micro-batch-size", "--batch-size", dest="micro_batch_size", type=int,
                   default=None, help="samples per data-parallel rank per forward (CPM-2 and "
                   "old Megatron call it --batch-size); or DeepSpeed's "
                   "train_micro_batch_size_per_gpu")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="samples per optimizer step over all ranks (default: micro batch x "
                        "data-parallel size x DeepSpeed's gradient_accumulation_steps)")
    g.add_argument("--train-iters", type=int, default=None, help="optimizer steps to train")
    g.add_argument("--train-samples", type=int, default=None,
                   help="instead of --train-iters: samples, rounded down to whole steps")
    g.add_argument("--eval-interval", type=int, default=1000,
                   help="evaluate on the validation split every this many steps (0: never)")
    g.add_argument("--eval-iters", type=int, default=100,
                   help="global batches per evaluation (the same ones each time)")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="save (with --save) and exit after a step divisible by this")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="save (with --save) and exit once this much time has passed")

    g = parser.add_argument_group("optimizer and learning rate")
    g.add_argument("--lr", type=float, default=None, help="peak learning rate")
    g.add_argument("--min-lr", type=float, default=0.0, help="the LR decays to this")
    g.add_argument("--lr-decay-style", choices=DECAY_STYLES, default="linear",
                   help="after warmup (Megatron's formulas; noam as in CPM-2)")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--lr-warmup-fraction", "--warmup", dest="lr_warmup_fraction", type=float,
                   default=None, help="warmup as a fraction of the decay steps (CPM-2: --warmup)")
    g.add_argument("--lr-warmup-iters", type=int, default=None,
                   help="warmup steps (linear from 0); or --lr-warmup-fraction")
    g.add_argument("--use-new-lr", "--override-opt-param-scheduler",
                   "--override-lr-scheduler", dest="lr_policy", action="store_const",
                   const="flags", default="check",
                   help="on --load, take the LR schedule from these flags, not the checkpoint")
    g.add_argument("--use-checkpoint-lr-scheduler", "--use-checkpoint-opt-param-scheduler",
                   dest="lr_policy", action="store_const", const="checkpoint",
                   help="on --load, take the LR schedule from the checkpoint")
    g.add_argument("--weight-decay", type=float, default=None,
                   help=f"AdamW weight decay, not applied to norms and biases "
                        f"(default {DEFAULTS['weight_decay']})")
    g.add_argument("--clip-grad", type=float, default=None,
                   help=f"global gradient-norm clipping, 0 for none (default "
                        f"{DEFAULTS['clip_grad']})")
    g.add_argument("--adam-beta1", type=float, default=None, help="default 0.9")
    g.add_argument("--adam-beta2", type=float, default=None, help="default 0.999")
    g.add_argument("--adam-eps", type=float, default=None, help="default 1e-8")

    g = parser.add_argument_group("precision")
    g.add_argument("--fp16", action="store_true", default=None,
                   help="fp16 with dynamic loss scaling (GPU only)")
    g.add_argument("--bf16", action="store_true", default=None,
                   help="bf16 weights and activations, fp32 master weights (ZeRO >= 1)")
    g.add_argument("--loss-scale", type=float, default=None,
                   help="static loss scale for --fp16 (default: dynamic)")
    g.add_argument("--initial-loss-scale", type=float, default=None,
                   help="first dynamic loss scale, a power of 2 (default 2^32)")
    g.add_argument("--min-loss-scale", type=float, default=None,
                   help="--fp16: the dynamic scale never drops below this (DeepSpeed: 1)")
    g.add_argument("--loss-scale-window", type=int, default=None,
                   help="--fp16: steps without overflow before the scale grows (DeepSpeed: 1000)")
    g.add_argument("--hysteresis", type=int, default=None,
                   help="--fp16: overflows tolerated before the scale shrinks (DeepSpeed: 2)")

    g = parser.add_argument_group("DeepSpeed")
    g.add_argument("--deepspeed", action="store_true",
                   help="accepted for Megatron-DeepSpeed / CPM-2 command lines: DeepSpeed is "
                        "always the engine")
    g.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config",
                   default=None, help="DeepSpeed JSON; without it the config is made from the "
                   "flags; with it, both are cross-checked")
    g.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=None,
                   help="ZeRO: 1 partitions optimizer states, 2 also gradients, 3 also "
                        "parameters (default 0, or the JSON's)")
    g.add_argument("--offload-optimizer", choices=("none", "cpu", "nvme"), default=None,
                   help="keep optimizer states (and the step) on cpu or nvme (ZeRO >= 1; nvme: "
                        "ZeRO 3)")
    g.add_argument("--offload-param", choices=("none", "cpu", "nvme"), default=None,
                   help="ZeRO-3 only")
    g.add_argument("--nvme-path", default=None, help="folder for nvme offload")

    g = parser.add_argument_group("checkpoints")
    g.add_argument("--save", default=None, help="checkpoint folder to write")
    g.add_argument("--save-interval", type=int, default=None,
                   help="save every this many steps (and always at the end)")
    g.add_argument("--load", default=None, help="checkpoint folder to resume from (a folder "
                   "with no checkpoint yet starts from scratch)")
    g.add_argument("--no-load-optim", action="store_true",
                   help="on --load, do not restore optimizer states")
    g.add_argument("--no-load-rng", action="store_true",
                   help="on --load, do not restore random-number-generator states")
    g.add_argument("--finetune", action="store_true",
                   help="on --load, take only the weights: iteration, samples, optimizer, "
                        "RNG and LR schedule start fresh")

    g = parser.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100, help="steps per log line")
    g.add_argument("--log-file", default=None, help="also append every log line here")
    g.add_argument("--tensorboard-dir", default=None, help="write TensorBoard scalars here")
    g.add_argument("--peak-tflops", type=float, default=None,
                   help="the device's peak TFLOP/s for MFU (default: from a table of GPUs)")
    g.add_argument("--dry-run", action="store_true",
                   help="validate, print parameter counts and a memory estimate per rank, exit")
    g.add_argument("--dry-run-device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="the device the --dry-run estimate is for (auto: this machine's; plan "
                        "a GPU cluster from a login node with cuda)")
    return parser


def world_size_from_env(env: Mapping[str, str]) -> int:
    """Processes in the job: torchrun / launchers set WORLD_SIZE, srun sets SLURM_NTASKS."""
    for key in ("WORLD_SIZE", "SLURM_NTASKS"):
        if env.get(key, "").isdigit():
            return int(env[key])
    return 1


def parse_args(argv: Optional[Sequence[str]] = None,
               env: Optional[Mapping[str, str]] = None) -> argparse.Namespace:
    """Parse and validate; raises ArgumentsError listing every problem."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    problems = validate(args, os.environ if env is None else env)
    if problems:
        raise ArgumentsError(problems)
    return args


def resolve_tokenizer(path: str, problems: List[str]) -> Optional[str]:
    """A SentencePiece model file; CPM-2's --tokenizer-path may name the folder holding it."""
    p = Path(path)
    if p.is_dir():
        models = sorted(p.glob("*.model"))
        if len(models) == 1:
            return str(models[0])
        problems.append(f"--tokenizer-path {path}: a folder must hold exactly one SentencePiece "
                        f"*.model file; found {len(models)}")
        return None
    if not p.is_file():
        problems.append(f"--tokenizer-model {path}: no such file")
        return None
    return str(p)


def validate(args: argparse.Namespace, env: Mapping[str, str]) -> List[str]:
    """Resolve the derived settings onto `args` and return every problem (empty: it can run)."""
    from megatron.model.config import ConfigError, T5Config, load_preset
    from megatron.model.t5 import model_parallel_problems
    from megatron.training import ds_config

    problems: List[str] = []
    # Launch layout.
    args.world_size = world_size_from_env(env)
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if tp < 1 or pp < 1:
        problems.append("--tensor-model-parallel-size and --pipeline-model-parallel-size must be "
                        ">= 1")
        tp, pp = max(tp, 1), max(pp, 1)
    if args.world_size % (tp * pp):
        problems.append(f"world size {args.world_size} is not divisible by "
                        f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp}")
    args.data_parallel_size = max(args.world_size // (tp * pp), 1)
    if pp > 1:
        problems.append(f"--pipeline-model-parallel-size {pp}: pipeline parallelism is not "
                        "available yet; use tensor parallelism and ZeRO (set it to 1)")

    # Required flags, all named at once.
    for flag, dest in (("--data-path", "data_path"), ("--tokenizer-model/--tokenizer-path",
                       "tokenizer_model"), ("--model-config", "model_config")):
        if getattr(args, dest) is None:
            problems.append(f"{flag} is required")
    if (args.train_iters is None) == (args.train_samples is None):
        problems.append("give exactly one of --train-iters and --train-samples")

    # Model.
    args.model = None
    if args.model_config is not None:
        try:
            path = Path(args.model_config)
            args.model = (T5Config.from_json(path) if path.suffix == ".json" or path.exists()
                          else load_preset(args.model_config))
        except (ConfigError, OSError, ValueError) as e:
            where = "" if args.model_config in str(e) else f" {args.model_config}"
            problems.append(f"--model-config{where}: {e}")
    if args.model is not None:
        problems += [f"--tensor-model-parallel-size {tp}: {p}"
                     for p in model_parallel_problems(args.model, tp)]
        for name in ("num_layers", "num_decoder_layers"):
            if getattr(args.model, name) % pp:
                problems.append(f"model {name} {getattr(args.model, name)} is not divisible by "
                                f"--pipeline-model-parallel-size {pp}")
    if args.make_vocab_size_divisible_by < 1:
        problems.append("--make-vocab-size-divisible-by must be >= 1")
    if args.checkpoint_num_layers < 1:
        problems.append("--checkpoint-num-layers must be >= 1")
    if not 0 <= args.label_smoothing < 1:
        problems.append("--label-smoothing must be in [0, 1)")

    # Files.
    if args.tokenizer_model is not None:
        args.tokenizer_model = resolve_tokenizer(args.tokenizer_model, problems)
    if args.tokenizer_model is not None and args.model is not None:
        problems += tokenizer_problems(args.tokenizer_model, args.vocab_extra_ids, args.model)
    if args.data_path is not None:
        try:
            parse_data_path(args.data_path)
        except ValueError as e:
            problems.append(str(e))

    # DeepSpeed config, batch sizes, precision, optimizer (fills the None flags).
    problems += ds_config.resolve(args)
    if args.lr is None:  # only now: the JSON's optimizer.params.lr may have supplied it
        problems.append("--lr is required (or optimizer.params.lr in the DeepSpeed JSON)")

    # Schedule.
    too_few_samples = False
    if args.train_samples is not None and args.global_batch_size:
        args.train_iters = args.train_samples // args.global_batch_size
        too_few_samples = args.train_iters == 0
        if too_few_samples:
            problems.append(f"--train-samples {args.train_samples} is less than one global batch "
                            f"({args.global_batch_size})")
    if args.train_iters is not None and args.global_batch_size and args.data_path is not None:
        data_problems = check_data_args(args)
        if too_few_samples:  # reported above, in terms of the flag that was given
            data_problems = [p for p in data_problems if not p.startswith("--train-iters")]
        problems += data_problems
        if not data_problems and args.decoder_seq_length is None:
            args.decoder_seq_length = t5_config_from_args(args).lengths()[2]
    if args.lr is not None:
        problems += lr_problems(args)
    for flag in ("log_interval", "save_interval", "exit_interval"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            problems.append(f"--{flag.replace('_', '-')} must be positive")
    if args.num_workers < 0:
        problems.append("--num-workers must be >= 0")
    if args.exit_duration_in_mins is not None and args.exit_duration_in_mins <= 0:
        problems.append("--exit-duration-in-mins must be positive")
    for flag in ("distributed_timeout_minutes", "data_timeout_minutes",
                 "checkpoint_timeout_minutes"):
        if getattr(args, flag) <= 0:
            problems.append(f"--{flag.replace('_', '-')} must be positive")

    # Checkpoints.
    if args.save_interval is not None and args.save is None:
        problems.append("--save-interval needs --save (where to write)")
    for flag in ("no_load_optim", "no_load_rng", "finetune"):
        if getattr(args, flag) and args.load is None:
            problems.append(f"--{flag.replace('_', '-')} needs --load")
    if args.lr_policy != "check" and args.load is None:
        problems.append("--use-new-lr / --use-checkpoint-lr-scheduler need --load")
    if args.finetune and args.lr_policy == "checkpoint":
        problems.append("--finetune starts the LR schedule fresh; --use-checkpoint-lr-scheduler "
                        "contradicts it")
    if args.load is not None and Path(args.load).exists() and not Path(args.load).is_dir():
        problems.append(f"--load {args.load} is a file; give the checkpoint folder")
    if args.save is not None and Path(args.save).exists() and not Path(args.save).is_dir():
        problems.append(f"--save {args.save} is a file; give a folder")
    if args.tensorboard_dir is not None and Path(args.tensorboard_dir).is_file():
        problems.append(f"--tensorboard-dir {args.tensorboard_dir} is a file")
    if args.load is not None and not problems:
        problems += checkpoint_problems(args)
    if args.dry_run_device != "auto" and not args.dry_run:
        problems.append("--dry-run-device has effect only with --dry-run")
    if args.peak_tflops is not None and args.peak_tflops <= 0:
        problems.append("--peak-tflops must be positive")
    return problems


def checkpoint_problems(args: argparse.Namespace) -> List[str]:
    """A checkpoint in --load that this layout cannot read (found before any process starts)."""
    from megatron.training import checkpointing

    root = Path(args.load)
    try:
        iteration = checkpointing.read_tracker(root) if root.is_dir() else None
        if iteration is None:
            return []
        meta = checkpointing.read_meta(root, iteration)
        return checkpointing.layout_problems(meta["layout"], args,
                                             args.finetune or args.no_load_optim)
    except checkpointing.CheckpointError as e:
        return [f"--load {args.load}: {e}"]


def tokenizer_problems(model_path: str, extra_ids: int, config) -> List[str]:
    """The tokenizer's ids must fit the model's embedding."""
    from megatron.data.tokenizer import T5Tokenizer

    try:
        size = len(T5Tokenizer(model_path, extra_ids=extra_ids))
    except Exception as e:  # noqa: BLE001 - sentencepiece raises plain RuntimeErrors
        return [f"--tokenizer-model {model_path}: cannot be loaded ({e})"]
    if size > config.vocab_size:
        return [f"--tokenizer-model {model_path} has {size} ids (with {extra_ids} sentinels) but "
                f"the model's vocab_size is {config.vocab_size}; raise vocab_size in "
                f"--model-config or lower --vocab-extra-ids"]
    return []


def lr_problems(args: argparse.Namespace) -> List[str]:
    from megatron.training.lr_schedule import from_args

    if args.train_iters is None or args.train_iters < 1:
        return []
    try:
        args.lr_schedule = from_args(args, args.train_iters)
    except ValueError as e:
        return [str(e)]
    return []


def args_to_dict(args: argparse.Namespace) -> Dict[str, object]:
    """The resolved flags as plain JSON values (for logs and checkpoints)."""
    out = {}
    for key, value in sorted(vars(args).items()):
        if key in ("model", "lr_schedule", "ds_config"):
            continue
        if isinstance(value, (str, int, float, bool, type(None))):
            out[key] = value
        elif isinstance(value, (list, tuple)):
            out[key] = [v if isinstance(v, (str, int, float, bool)) else str(v) for v in value]
        else:
            out[key] = str(value)
    return out
