"""Every command-line flag of `megatron.pretrain_t5`, under Megatron-LM and CPM-2 names.

`parse_args(argv, env)` parses, then `validate` resolves what follows from the flags (world and
data-parallel size, batch sizes, precision, the model config, the DeepSpeed config) into the
typed, frozen `megatron.config.RunConfig`, and lists every problem at once, before any process
group is created or any data is read. Each part is checked by the module it configures
(`model/settings.py`, `data/data_args.py`, `training/ds_config.py`, `config/lr_schedule.py`,
`checkpoint/io/checkpointing.py`, `initialize.py`); this module only collects. Flags that have no
effect in some combination are refused, never silently ignored.

Flags that DeepSpeed's JSON may also set (batch sizes, clipping, precision, loss scaling, the
optimizer's hyperparameters, the ZeRO stage and offload) default to None here, so that "not
given" can be told from "given as the default": a value given on both sides must agree; a value
given on one side is taken by the other.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from megatron.checkpoint.io.checkpointing import (
    checkpoint_flag_problems,
    checkpoint_problems,
    layout,
    meta_problems,
)
from megatron.checkpoint.io.ownership import lock_problems
from megatron.checkpoint.io.remote import remote_meta, remote_problems
from megatron.checkpoint.io.prompt import prompt_checkpoint_problems, \
    prompt_layout_from_checkpoints, resumes_prompt_run
from megatron.cli import RENAMED_FLAGS, CommandLineParser
from megatron.config import Layout, ParallelConfig, RunConfig, RuntimeConfig
from megatron.config.lr_schedule import DECAY_STYLES
from megatron.config.lr_schedule import from_args as lr_from_args
from megatron.config.training import BatchConfig, CheckpointConfig, LoggingConfig, OptimizerConfig
from megatron.data.data_args import add_data_args, resolve_data, t5_config_from_args
from megatron.data.datasets.t5_dataset import T5DatasetConfig
from megatron.data.storage.object_storage import ObjectStorageError, is_remote
from megatron.initialize import choose_device
from megatron.model.settings import ModelConfig, add_moe_args, cpm2_layout_problems, \
    moe_layout_problems, resolve_model
from megatron.model.transformer import ATTENTION_BACKENDS
from megatron.pipeline.partition import cut_problems
from megatron.training import ds_config
from megatron.config.divergence_args import divergence_config, divergence_problems
from megatron.config.checkpoint_args import add_checkpoint_args
from megatron.config.checkpoint_storage import checkpoint_storage_from_args
from megatron.config.flag_checks import command_line_problems, defaults_of
from megatron.config.given_flags import GIVEN, given_dests, record_given
from megatron.config.prompt_args import add_prompt_args, prompt_problems
from megatron.training.ds_config import OPTIMIZER_DEFAULTS
from megatron.training.finetune_metrics import metric_problems
from megatron.training.profiling import add_profile_args, profile_config, profile_problems


class ArgumentsError(ValueError):
    """The command line (with its files) cannot run; `problems` lists every reason."""

    def __init__(self, problems: Sequence[str], log_file: Optional[str] = None) -> None:
        self.problems = list(problems)
        self.log_file = log_file
        """The command line's --log-file, where the entry point copies the message."""
        super().__init__("\n".join(f"  - {p}" for p in self.problems))


def build_parser() -> argparse.ArgumentParser:
    """Every flag of the entry point, group by group (docs/flags.md is made from it)."""
    parser = CommandLineParser(
        prog="python -m megatron.pretrain_t5", allow_abbrev=False, renamed=RENAMED_FLAGS,
        job=True,
        description="Pretrain a T5 / CPM-2 encoder-decoder with DeepSpeed and tensor parallelism.")
    add_data_args(parser, schedule=False)
    for action in parser._actions:  # checked in validate(), with every other problem
        action.required = False
    _add_model_args(parser)
    add_moe_args(parser)
    _add_parallel_args(parser)
    _add_batch_args(parser)
    _add_optimizer_args(parser)
    _add_precision_args(parser)
    _add_deepspeed_args(parser)
    add_checkpoint_args(parser)
    _add_logging_args(parser)
    add_prompt_args(parser)
    add_profile_args(parser)
    record_given(parser)  # which flags were given, and as which alias: validate() reads it
    return parser


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model")
    g.add_argument("--model-config", help="model JSON (Hugging Face T5 config.json or CPM-2's "
                   "enc_dec config) or a preset name from configs/model (e.g. t5-base)")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the embedding to a multiple of this x tensor-parallel size")
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                   help="attention kernel: auto picks sdpa on CUDA and for cross-attention; "
                        "flex computes the relative bias inside FlexAttention (training on "
                        "CUDA only)")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile each transformer block (the first steps compile; the "
                        "losses are the uncompiled run's)")
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


def _add_parallel_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("parallelism and launch")
    g.add_argument("--tensor-model-parallel-size", "--model-parallel-size",
                   dest="tensor_model_parallel_size", type=int, default=1,
                   help="split attention heads, d_ff and the vocabulary over this many ranks")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="cut the model into this many pipeline stages (DeepSpeed's pipeline "
                        "engine; ZeRO 0 or 1); world = tensor x pipeline x data parallel")
    g.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="split the experts of a Mixture-of-Experts model over this many ranks "
                        "of the data-parallel group (tokens go to their experts by all-to-all)")
    g.add_argument("--pipeline-model-parallel-split-rank", type=int, default=None,
                   help="the encoder on stages below this rank, the decoder on the others "
                        "(default: stages cut by each layer's cost)")
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


def _add_batch_args(parser: argparse.ArgumentParser) -> None:
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
    g.add_argument("--eval-log-samples", type=int, default=0,
                   help="at each evaluation, log this many decoded examples of the first "
                        "batch (input, target, the model's greedy fill) and write them to "
                        "TensorBoard")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="save (with --save) and exit after a step divisible by this")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="save (with --save) and exit once this much time has passed")


def _add_optimizer_args(parser: argparse.ArgumentParser) -> None:
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
                        f"(default {OPTIMIZER_DEFAULTS['weight_decay']})")
    g.add_argument("--clip-grad", type=float, default=None,
                   help=f"global gradient-norm clipping, 0 for none (default "
                        f"{OPTIMIZER_DEFAULTS['clip_grad']})")
    g.add_argument("--adam-beta1", type=float, default=None, help="default 0.9")
    g.add_argument("--adam-beta2", type=float, default=None, help="default 0.999")
    g.add_argument("--adam-eps", type=float, default=None, help="default 1e-8")


def _add_precision_args(parser: argparse.ArgumentParser) -> None:
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


def _add_deepspeed_args(parser: argparse.ArgumentParser) -> None:
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


def _add_logging_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100, help="steps per log line")
    g.add_argument("--log-file", default=None, help="also append every log line here")
    g.add_argument("--tensorboard-dir", default=None, help="write TensorBoard scalars here")
    g.add_argument("--peak-tflops", type=float, default=None,
                   help="the device's peak TFLOP/s for MFU (default: from a table of GPUs)")
    g.add_argument("--no-plots", dest="plots", action="store_false",
                   help="do not draw the run's figures into SAVE/plots/ when a run with --save "
                        "ends (python -m megatron.plot draws them at any time)")
    g.add_argument("--log-grad-norms-per-layer", action="store_true",
                   help="every --log-interval steps, log the gradient norm (before clipping) of "
                        "each layer group: embedding, encoder/decoder blocks, final layer "
                        "norms, lm_head; also TensorBoard grad-norm-per-layer/<group>")
    g.add_argument("--dry-run", action="store_true",
                   help="validate, print parameter counts and a memory estimate per rank, exit")
    g.add_argument("--dry-run-device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="the device the --dry-run estimate is for (auto: this machine's; plan "
                        "a GPU cluster from a login node with cuda)")


def world_size_from_env(env: Mapping[str, str]) -> int:
    """Processes in the job: torchrun / launchers set WORLD_SIZE, srun sets SLURM_NTASKS."""
    for key in ("WORLD_SIZE", "SLURM_NTASKS"):
        if env.get(key, "").isdigit():
            return int(env[key])
    return 1


def parse_args(argv: Optional[Sequence[str]] = None,
               env: Optional[Mapping[str, str]] = None) -> RunConfig:
    """Parse and validate; the run's configuration.

    Raises:
        ArgumentsError: listing every problem of the flags and the files they name.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    # unknown flags (named with their replacement, megatron/cli.py) are listed with the
    # problems of the others; a malformed value stops the checks: nothing else can be read
    args, _, unknown = build_parser().parse_collecting(argv)
    if args is None:
        raise ArgumentsError(unknown)
    config, problems = validate(args, os.environ if env is None else env)
    if unknown or problems:
        raise ArgumentsError(unknown + problems, args.log_file)
    return config


def resume_problems(values: Dict, now: Dict[str, int], lr_schedule, storage=None
                    ) -> List[str]:
    """What the checkpoints this run reads contradict in its flags (layout, LR schedule): --load's
    (an s3:// one's meta.json read from `storage`, but for --dry-run) and, for a requeued
    prompt-tuning job, --save's (which it resumes from), found before any process starts."""
    problems = []
    if is_remote(values["load"]):
        if storage is not None and not values["dry_run"]:
            problems += _remote_resume_problems(values, now, lr_schedule, storage)
    elif values["load"] is not None:
        problems += checkpoint_problems(values["load"], now,
                                        values["finetune"] or values["no_load_optim"],
                                        lr_schedule, values["lr_policy"], values["finetune"],
                                        not values["no_load_rng"], values["ckpt_step"])
    if not problems and resumes_prompt_run(values) is not None:
        save = values["save"]
        problems += checkpoint_problems(save, now, False, lr_schedule, values["lr_policy"],
                                        label=f"--save {save} (resumed)")
    return problems


def _remote_resume_problems(values: Dict, now: Dict[str, int], lr_schedule, storage
                            ) -> List[str]:
    load = values["load"]
    try:
        meta = remote_meta(load, storage, values["ckpt_step"])
    except (ObjectStorageError, ValueError) as e:
        return [f"--load {load}: {e}"]
    if meta is None:
        return []
    return meta_problems(meta, load, now, values["finetune"] or values["no_load_optim"],
                         lr_schedule, values["lr_policy"], values["finetune"])


def validate(args: argparse.Namespace, env: Mapping[str, str]
             ) -> Tuple[Optional[RunConfig], List[str]]:
    """(the run's configuration, every problem); the configuration is None unless the list is
    empty. `args` is read, never written: what follows from the flags (sizes, the JSON's values,
    defaults) is resolved into a copy and from there into the typed parts. Each part is checked
    by the module it configures; this function only collects."""
    problems: List[str] = []
    values = dict(vars(args))
    given = given_dests(values, defaults_of(_shared_parser()))
    values.pop(GIVEN, None)
    parallel = resolve_parallel(values, env, problems)
    if values["data_path"] is None and values["finetune_data"] is None:
        problems.append("--data-path is required (or --finetune-data, for fine-tuning)")
    if values["model_config"] is None:
        problems.append("--model-config is required")
    if (values["train_iters"] is None) == (values["train_samples"] is None):
        problems.append("give exactly one of --train-iters and --train-samples")

    device_type, backend, warnings = choose_device(values["distributed_backend"])
    resolved, values, model, layout_problems = resolve_layout(values, parallel, device_type)
    values.update(world_size=parallel.world_size, data_parallel_size=parallel.data_parallel_size,
                  device_type=device_type, distributed_backend=backend, warnings=warnings)
    problems += layout_problems
    problems += command_line_problems(vars(args), given, model.t5 if model else None)
    if resolved.optimizer.lr is None:  # only now: the JSON's optimizer.params.lr may supply it
        problems.append("--lr is required (or optimizer.params.lr in the DeepSpeed JSON)")

    global_batch = resolved.batch.global_batch_size
    too_few_samples = False
    if values["train_samples"] is not None and global_batch:
        values["train_iters"] = values["train_samples"] // global_batch
        too_few_samples = values["train_iters"] == 0
        if too_few_samples:
            problems.append(f"--train-samples {values['train_samples']} is less than one global "
                            f"batch ({global_batch})")
    schedule = (values["train_iters"], global_batch) \
        if values["train_iters"] is not None and global_batch else None
    data, data_problems = resolve_data(values, model.t5.vocab_size if model else None, schedule,
                                       too_few_samples)
    problems += data_problems
    problems += metric_problems(values, data)
    if data is not None:
        values.update(tokenizer_model=data.tokenizer_model, tokenizer_type=data.tokenizer_type,
                      vocab_file=None, decoder_seq_length=data.decoder_seq_length)
    lr_schedule = None
    if resolved.optimizer.lr is not None and values["train_iters"] is not None \
            and values["train_iters"] >= 1:
        try:
            lr_schedule = lr_from_args(argparse.Namespace(**values), values["train_iters"])
        except ValueError as e:
            problems.append(str(e))
    problems += loop_problems(values)
    problems += checkpoint_flag_problems(values)
    problems += divergence_problems(values)
    prompt_taken, more = prompt_layout_from_checkpoints(values, given)
    prompt_values = {**values, **prompt_taken}
    problems += (prompt_checkpoint_problems(prompt_values)
                 or prompt_problems(prompt_values, given)) + more
    values.update(prompt_taken)
    problems += profile_problems(values, parallel.world_size)
    if values["save"] is not None and not values["dry_run"]:
        problems += lock_problems(values["save"])
    storage, storage_problems = checkpoint_storage_from_args(values)
    problems += storage_problems
    if not problems and not values["dry_run"]:  # requests: only once the flags are right
        problems += remote_problems(values, storage, given)
    if not problems:
        problems += resume_problems(values, layout(parallel, resolved.zero.stage), lr_schedule,
                                    storage)
    if problems:
        return None, problems
    batch = BatchConfig(resolved.batch.micro_batch_size, global_batch,
                        resolved.batch.gradient_accumulation_steps, values["train_iters"],
                        values["eval_interval"], values["eval_iters"],
                        values["eval_log_samples"])
    optimizer = OptimizerConfig(schedule=lr_schedule, **vars(resolved.optimizer))
    divergence = divergence_config(values)
    if divergence.enabled:  # the thresholds in force, for the flags line and meta.json
        values.update(divergence_loss_spike_factor=divergence.loss_spike_factor,
                      divergence_loss_window=divergence.loss_window,
                      divergence_zero_grad_steps=divergence.zero_grad_steps,
                      divergence_weight_growth=divergence.weight_growth)
    checkpoint = _checkpoint_config(values, divergence, storage)
    logging = LoggingConfig(values["log_interval"], values["log_file"],
                            values["tensorboard_dir"], values["peak_tflops"],
                            values["log_grad_norms_per_layer"], plots=values["plots"])
    runtime = RuntimeConfig(device_type, backend, values["local_rank"], values["seed"],
                            values["distributed_timeout_minutes"],
                            values["data_timeout_minutes"], values["data_cache_timeout"],
                            values["exit_interval"], values["exit_duration_in_mins"],
                            tuple(warnings))
    return RunConfig(parallel, batch, optimizer, resolved.precision, resolved.zero, model, data,
                     checkpoint, logging, runtime, deepspeed=resolved.json,
                     flags=args_to_dict(values), dry_run=values["dry_run"],
                     dry_run_device=values["dry_run_device"],
                     profile=profile_config(values)), []


def _checkpoint_config(values: Dict, divergence, storage) -> CheckpointConfig:
    """validate()'s CheckpointConfig of the resolved flags."""
    return CheckpointConfig(values["save"], values["save_interval"], values["load"],
                            values["no_load_optim"], values["no_load_rng"], values["finetune"],
                            values["lr_policy"], values["checkpoint_timeout_minutes"],
                            keep_last=values["keep_last"], async_save=values["async_save"],
                            check_for_nan=values["check_for_nan"],
                            detect_nan_layers=values["detect_nan_layers"],
                            divergence=divergence, ckpt_step=values["ckpt_step"],
                            storage=storage)


def resolve_layout(values: Dict[str, object], parallel: ParallelConfig, device_type: str
                   ) -> Tuple[ds_config.Resolved, Dict[str, object], Optional[ModelConfig],
                              List[str]]:
    """The flags that fix what a rank holds: the flags and DeepSpeed's JSON cross-checked, the
    model, the pipeline cut. Returns (the agreed settings, the flags with the JSON's values
    filled in, the model or None, the problems)."""
    resolved, values, problems = ds_config.resolve(
        values, parallel.data_parallel_size, parallel.model_parallel_size, device_type)
    model, model_problems = resolve_model(values, parallel.tensor_model_parallel_size,
                                          parallel.pipeline_model_parallel_size,
                                          resolved.checkpoint_activations,
                                          parallel.expert_model_parallel_size)
    problems = model_problems + problems
    if model is not None:
        problems += moe_layout_problems(model.t5, parallel, resolved.zero.stage,
                                        resolved.precision.precision)
        problems += cpm2_layout_problems(model.t5, parallel, resolved.batch.micro_batch_size,
                                         _sample_lengths(values))
    if model is not None:
        problems += cut_problems(model.t5, parallel.pipeline_model_parallel_size,
                                 parallel.pipeline_split_rank)
        problems += flex_problems(model, parallel, device_type)
    return resolved, values, model, problems


def _sample_lengths(values: Mapping[str, object]) -> Dict[str, Optional[int]]:
    """flag -> the encoder and decoder lengths of the samples (the span-corruption target length
    when --decoder-seq-length is not given; None where not known before the data: UL2)."""
    encoder, decoder = values.get("encoder_seq_length"), values.get("decoder_seq_length")
    if values.get("t5_objective") in (None, "span-corruption") and isinstance(encoder, int):
        try:
            _, encoder, decoder = T5DatasetConfig(
                encoder, decoder, values["noise_density"], values["mean_noise_span_length"]
            ).lengths()
        except (ValueError, KeyError, TypeError):
            pass  # (reported where the data flags are checked)
    elif values.get("t5_objective") == "ul2":
        encoder = decoder = None
    return {"--encoder-seq-length": encoder, "--decoder-seq-length": decoder}


def flex_problems(model: ModelConfig, parallel: ParallelConfig, device_type: str) -> List[str]:
    """What keeps --attention-backend flex from training here (megatron/model/flex.py)."""
    if model.attention_backend != "flex":
        return []
    out = []
    alternatives = "use --attention-backend eager, sdpa or auto for training (flex may serve " \
        "evaluation and inference: T5Model(..., attention_backend='flex'))"
    if device_type != "cuda":
        out.append(f"--attention-backend flex cannot train on the {device_type}: torch's "
                   f"FlexAttention (2.13) has no backward there; " + alternatives)
    if model.t5.dropout_rate > 0:
        out.append(f"--attention-backend flex has no attention dropout, and the model's "
                   f"dropout_rate is {model.t5.dropout_rate}; " + alternatives)
    if parallel.pipeline_model_parallel_size > 1:
        out.append("--attention-backend flex with --pipeline-model-parallel-size > 1: the "
                   "pipeline's stages carry a bias tensor; " + alternatives)
    return out


@functools.lru_cache(maxsize=1)
def _shared_parser() -> argparse.ArgumentParser:
    return build_parser()


def layout_from_flags(argv: Sequence[str], world_size: int, device_type: str = "cuda"
                      ) -> Tuple[Optional[Layout], List[str]]:
    """The layout of a run (`megatron.config.Layout`) from its command line alone, resolved as
    `validate` resolves it for `world_size` processes on `device_type`; no data, tokenizer or
    checkpoint file is read, and the data and schedule flags may be left out. The planner's way
    to the memory estimate that `--dry-run` prints for the same flags. Returns (the layout or
    None, the problems)."""
    values = dict(vars(_shared_parser().parse_args(list(argv))))
    values.pop(GIVEN, None)
    problems: List[str] = []
    parallel = resolve_parallel(values, {"WORLD_SIZE": str(world_size)}, problems)
    resolved, values, model, more = resolve_layout(values, parallel, device_type)
    problems += more
    if values["model_config"] is None:
        problems.append("--model-config is required")
    try:
        if values.get("t5_objective") == "ul2":  # its lengths need the tokenizer's mode tokens
            lengths = t5_config_from_args(argparse.Namespace(**values))
        else:
            lengths = T5DatasetConfig(values["encoder_seq_length"], values["decoder_seq_length"],
                                      values["noise_density"], values["mean_noise_span_length"])
        _, encoder, decoder = lengths.lengths()
    except ValueError as e:
        problems.append(str(e))
    batch = resolved.batch
    if batch.micro_batch_size is None or batch.global_batch_size is None:
        problems.append("give --micro-batch-size (the global batch follows from it)")
    if problems or model is None:
        return None, problems
    return Layout(parallel, BatchConfig(batch.micro_batch_size, batch.global_batch_size,
                                        batch.gradient_accumulation_steps),
                  resolved.precision, resolved.zero, model, encoder, decoder, resolved.json), []


def resolve_parallel(values: Dict[str, object], env: Mapping[str, str],
                     problems: List[str]) -> ParallelConfig:
    """World = tensor x pipeline x data parallel."""
    world = world_size_from_env(env)
    tp, pp = values["tensor_model_parallel_size"], values["pipeline_model_parallel_size"]
    if tp < 1 or pp < 1:
        problems.append("--tensor-model-parallel-size and --pipeline-model-parallel-size must be "
                        ">= 1")
        tp, pp = max(tp, 1), max(pp, 1)
    if world % (tp * pp):
        problems.append(f"world size {world} is not divisible by "
                        f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp}")
    data = max(world // (tp * pp), 1)
    ep = values["expert_model_parallel_size"]
    if ep < 1 or data % ep:
        problems.append(f"--expert-model-parallel-size {ep} does not divide the data-parallel "
                        f"size {data} (world {world} / (tensor {tp} x pipeline {pp}))")
        ep = 1
    return ParallelConfig(world, tp, pp, data, values["pipeline_model_parallel_split_rank"],
                          ep)


def loop_problems(values: Mapping[str, object]) -> List[str]:
    """The loop's intervals, evaluation samples, exit conditions, deadlines, log folder, the
    dry run's device and the peak TFLOP/s."""
    problems = []
    if values["eval_log_samples"] < 0:
        problems.append("--eval-log-samples must be 0 or more")
    for flag in ("log_interval", "save_interval", "exit_interval"):
        if values[flag] is not None and values[flag] < 1:
            problems.append(f"--{flag.replace('_', '-')} must be positive")
    if values["exit_duration_in_mins"] is not None and values["exit_duration_in_mins"] <= 0:
        problems.append("--exit-duration-in-mins must be positive")
    for flag in ("distributed_timeout_minutes", "data_timeout_minutes",
                 "checkpoint_timeout_minutes"):
        if values[flag] <= 0:
            problems.append(f"--{flag.replace('_', '-')} must be positive")
    if values["tensorboard_dir"] is not None and Path(values["tensorboard_dir"]).is_file():
        problems.append(f"--tensorboard-dir {values['tensorboard_dir']} is a file")
    if values["dry_run_device"] != "auto" and not values["dry_run"]:
        problems.append("--dry-run-device has effect only with --dry-run")
    if values["peak_tflops"] is not None and values["peak_tflops"] <= 0:
        problems.append("--peak-tflops must be positive")
    return problems


def args_to_dict(values: Mapping[str, object]) -> Dict[str, object]:
    """The resolved flags as plain JSON values (for logs and checkpoints)."""
    out = {}
    for key, value in sorted(values.items()):
        if isinstance(value, (str, int, float, bool, type(None))):
            out[key] = value
        elif isinstance(value, (list, tuple)):
            out[key] = [v if isinstance(v, (str, int, float, bool)) else str(v) for v in value]
        else:
            out[key] = str(value)
    return out
