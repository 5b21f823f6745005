"""Pretrain a T5 / CPM-2 encoder-decoder: `torchrun --nproc_per_node N -m megatron.pretrain_t5 ...`.

Also runs under `srun` (one task per device), `python -m torch.distributed.launch`, the
`deepspeed` launcher, or as a plain `python -m megatron.pretrain_t5` (one process). Every flag is
checked before anything starts (see megatron/arguments.py); `--dry-run` stops after the checks
with parameter counts and a per-rank memory estimate. Exit status: 0 done (or stopped by an exit
condition after saving), 2 bad command line, 1 a failure while running.

`pretrain` reads as its steps: the writer lock and DeepSpeed's start (`pretrain`), then the log's
first lines, the step (`build_step`), the checkpoint (`_resume`), the data, the saver
(`_saver`), the loop (training/loop.py), the final evaluation and the figures.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron import parallel_state
from megatron.arguments import ArgumentsError, parse_args
from megatron.checkpoint.formats.deepspeed_files import CheckpointReadError
from megatron.checkpoint.formats.meta import (PROMPT_ALONE, PROMPT_WITH_MODEL, CheckpointKind,
                                              kind_of, read_meta)
from megatron.checkpoint.io.checkpointing import CheckpointError, layout, load_checkpoint, \
    load_iteration, resumes_schedule, tag_for
from megatron.checkpoint.io.completeness import MANIFEST
from megatron.checkpoint.io.remote import is_remote
from megatron.checkpoint.io.remote_saver import RemoteSaver
from megatron.checkpoint.io.ownership import SaveLock, SaveLockError, describe, watch_launcher
from megatron.checkpoint.io.reshard import RESHARDED
from megatron.checkpoint.io.prompt import resumes_prompt_run
from megatron.checkpoint.io.saver import Saver
from megatron.cli import EXIT_USAGE, speak_for_the_job
from megatron.config import RunConfig
from megatron.config.prompt_args import prompt_settings
from megatron.config.lr_schedule import resolve_with_checkpoint
from megatron.cost.report import print_dry_run
from megatron.failures import DataError, RunFailure, append_to_log, report_failure
from megatron.initialize import PortInUse, distributed_env, join_deepspeed, join_process_group, \
    set_seeds
from megatron.model.flops import training_step_flops
from megatron.training.data_workers import reap_daemonic_children
from megatron.training.engine import build_model, count_parameters, initialize_engine
from megatron.training.finetune_metrics import (accuracy_name, generation_line, generation_scalars,
                                               validation_generation)
from megatron.training.layer_norms import layer_groups
from megatron.training.loaders import build_data
from megatron.training.loop import (LoopParts, StepCost, TrainState, evaluate_and_log,
                                    run_tokenizer, train)
from megatron.training.metrics import MetricsWriter, peak_tflops
from megatron.training.pipeline_step import build_pipeline_step
from megatron.training.profiling import StepProfiler
from megatron.training.signals import StopSignals
from megatron.training.step import DataParallelStep
from megatron.training.watchdog import Watchdog


def build_step(config: RunConfig, watchdog, writer):
    """The training step for this layout: DeepSpeed's pipeline engine with P > 1, else its
    data-parallel engine (both with tensor parallelism)."""
    if config.parallel.pipeline_model_parallel_size > 1:
        return build_pipeline_step(config, watchdog, writer)
    runtime = config.runtime
    collective_s = 60 * runtime.distributed_timeout_minutes
    with watchdog.watch("building the model (ZeRO-3 partitions it with the other ranks)",
                        collective_s):
        model = build_model(config.model, config.zero, runtime.torch_device(),
                            config.deepspeed_json(), prompt_settings(config.flags))
    writer.write_text(f"parameters on tensor rank 0: {count_parameters(model):,}")
    with watchdog.watch("engine setup (DeepSpeed broadcasts and partitions the weights "
                        "with the other ranks)", collective_s):
        engine, _ = initialize_engine(config.optimizer, config.zero, runtime.device_type,
                                      config.deepspeed_json(), model)
    return DataParallelStep(engine, runtime.torch_device(), config.optimizer.clip_grad,
                            config.model.expert_bias_update_rate)


def step_cost(config: RunConfig):
    """Model FLOPs of a global batch and the device's peak, for the metrics line."""
    model = config.model
    vocab = model.t5.padded_vocab_size(model.make_vocab_size_divisible_by,
                                       config.parallel.tensor_model_parallel_size)
    flops = training_step_flops(model.t5, config.batch.global_batch_size,
                                config.data.encoder_seq_length, config.data.decoder_seq_length,
                                vocab).model
    device_name = torch.cuda.get_device_name() if config.runtime.device_type == "cuda" \
        else "cpu"
    return StepCost(flops, peak_tflops(device_name, config.precision.precision,
                                       config.logging.peak_tflops))


def pretrain(config: RunConfig, signals=None, watchdog=None, listeners: Sequence = ()):
    """Train with a validated config on an initialized process group; returns the TrainState.

    signals: a StopSignals already installed by the caller (main installs one before anything
    slow starts, so that a signal during start-up stops the run at its first step boundary).
    watchdog: the caller's (main starts one before the process group); else one of its own.
    listeners: timing listeners of the step's named ranges (megatron/training/timing.py), given
    to this run's profiler.

    First, before anything costly or visible, rank 0 takes --save's writer lock and every rank
    learns the verdict; only then does DeepSpeed start (it builds or loads a compiled op). A
    finished run ends with a barrier after the lock's release: every rank checks the lock with
    the flags (checkpoint/io/ownership.py), so none may start a next run on the folder, in
    this process group or another job, while rank 0 still holds it.

    Raises:
        RunFailure (megatron/failures.py), after reporting it once.
    """
    runtime = config.runtime
    own_watchdog = watchdog is None
    watchdog = watchdog or Watchdog(dist.get_rank())
    lock, finished = None, False
    try:
        if config.checkpoint.save is not None and not is_remote(config.checkpoint.save):
            with watchdog.watch("collective: the verdict on --save's writer lock",
                                60 * runtime.distributed_timeout_minutes):
                lock = _take_save_lock(config.checkpoint.save, runtime.torch_device())
        # + 5 minutes: DeepSpeed may compile its communication op first
        with watchdog.watch("DeepSpeed's communication backend (it builds or loads a compiled "
                            "op under a lock file in ~/.cache/torch_extensions or "
                            "$TORCH_EXTENSIONS_DIR; a process killed while holding it leaves "
                            "the file behind and every later start waits here: remove it)",
                            60 * runtime.distributed_timeout_minutes + 300):
            join_deepspeed()
        state = _pretrain(config, signals, watchdog, lock, listeners)
        finished = True
        return state
    except RunFailure as e:
        report_failure(e, dist.get_rank(), config.logging.log_file)
        raise
    finally:
        if lock is not None:
            lock.release()
        if finished:  # no rank leaves before the lock is gone (a failed rank's peers may be)
            with watchdog.watch("collective: the barrier before leaving",
                                60 * runtime.distributed_timeout_minutes):
                dist.barrier()
        if own_watchdog:
            watchdog.close()


def _pretrain(config: RunConfig, signals, watchdog, lock, listeners: Sequence = ()):
    """pretrain's body, holding --save's lock (None without --save, or on ranks other than 0)."""
    rank, runtime, ckpt = dist.get_rank(), config.runtime, config.checkpoint
    writer = MetricsWriter(config.logging.log_file, config.logging.tensorboard_dir,
                           enabled=rank == 0, train_iters=config.batch.train_iters)
    watchdog.place = _place(config)
    saver = loaders = None
    profiler = StepProfiler(config.profile, rank, runtime.device_type,
                            writer.write_text if rank == 0 else print, listeners)
    try:
        _log_start(config, writer, lock)
        set_seeds(runtime.seed, runtime.device_type)
        step = build_step(config, watchdog, writer)
        _instrument(step, config, profiler)
        prompt_resume = resumes_prompt_run(config.flags)  # a requeued prompt-tuning job
        state, schedule = _resume(step, config, writer, watchdog,
                                  base_of=config.checkpoint.save if prompt_resume else None)
        prompt_base = _start_prompt(step, config, writer, prompt_resume)
        if prompt_resume is not None:
            state, schedule = _resume(step, config, writer, watchdog, _prompt_resume(config))
        with watchdog.watch("data: building the datasets (index caches; another rank may be "
                            "building them)", runtime.data_cache_timeout_s + 60):
            loaders = build_data(config.data, config.batch, runtime.device_type,
                                 state.consumed_samples,
                                 parallel_state.is_pipeline_first_stage() or
                                 parallel_state.is_pipeline_last_stage())
        if loaders.train is None:
            raise DataError("the train split is empty: check --split and --data-path")
        saver = _saver(step, config, writer, watchdog, prompt_base) \
            if ckpt.save is not None else None

        def save(s: TrainState, hold: bool = False) -> None:
            if saver.save(s.iteration, s.consumed_samples, schedule.state_dict(),
                          hold) is None and saver.pending is not None:
                writer.write_text(f"saving checkpoint {s.iteration} in the background")

        if state.iteration < config.batch.train_iters:
            with contextlib.ExitStack() as stack:
                if signals is None:
                    signals = stack.enter_context(StopSignals())
                parts = LoopParts(config=config, step=step, cost=step_cost(config),
                                  schedule=schedule, train_loader=loaders.train,
                                  valid_loader=loaders.valid, writer=writer, save=save,
                                  signals=signals, watchdog=watchdog, saves=saver,
                                  profiler=profiler)
                state = train(parts, state)
        if not state.exit_reason:
            _final_evaluation(step, config, state, writer, watchdog, loaders.valid,
                              loaders.test)
        loaders.close()  # the workers' memory back before the figures
        if rank == 0 and ckpt.save is not None and config.logging.plots \
                and not is_remote(ckpt.save) and not state.exit_reason.startswith("signal"):
            _plot(config, writer)  # a signal's grace period is the scheduler's, not the figures'
        return state
    finally:
        profiler.finish()  # a run that failed inside the window: the steps it recorded
        if loaders is not None:  # every path: workers ignore SIGTERM (training/data_workers.py)
            loaders.close()
        if saver is not None:
            saver.close()
        writer.close()


def _place(config: RunConfig) -> str:
    """Where this rank sits, for the watchdog's messages ('' without model parallelism)."""
    parallel = config.parallel
    if parallel.model_parallel_size == 1:
        return ""
    return (f" (pipeline stage {parallel_state.get_pipeline_model_parallel_rank()} of "
            f"{parallel.pipeline_model_parallel_size}, tensor rank "
            f"{parallel_state.get_tensor_model_parallel_rank()}, data-parallel rank "
            f"{parallel_state.get_data_parallel_rank()})")


def _log_start(config: RunConfig, writer: MetricsWriter, lock) -> None:
    """The log's first lines: warnings, the flags and DeepSpeed's JSON as resolved."""
    for warning in config.runtime.warnings:
        writer.write_text(f"warning: {warning}")
    writer.write_text("flags: " + json.dumps(config.flags, sort_keys=True))
    writer.write_text("deepspeed config: " + json.dumps(config.deepspeed, sort_keys=True))
    ul2 = config.data.dataset.t5.ul2
    if ul2 is not None:
        writer.write_text(ul2.describe_start(config.data.encoder_seq_length,
                                             config.data.decoder_seq_length))
    if lock is not None and lock.took_over is not None:
        writer.write_text(f"warning: --save {config.checkpoint.save}: took over the writer lock "
                          f"of a job that is gone ({describe(lock.took_over)})")


def _instrument(step, config: RunConfig, profiler: StepProfiler) -> None:
    """The profiler's ranges, per-layer gradient norms and the NaN watch, as the flags ask."""
    profiler.instrument(step)
    if config.logging.grad_norms_per_layer:
        t5 = config.model.t5
        step.watch_layer_grad_norms(layer_groups(t5.num_layers, t5.num_decoder_layers,
                                                 t5.tie_word_embeddings))
    if config.checkpoint.check_for_nan:
        step.watch_nonfinite(config.checkpoint.detect_nan_layers)


def _resume(step, config: RunConfig, writer: MetricsWriter, watchdog, ckpt=None,
            base_of: Optional[str] = None):
    """(the state to start from, the LR schedule) after --load, if any: from scratch, weights
    only (--finetune, or a checkpoint of weights alone), or a resume.

    ckpt: the checkpoint settings to load with (default: the flags'; `_prompt_resume`'s for a
        prompt-tuning run resuming from its --save).
    base_of: the --save a requeued prompt-tuning run resumes from next (its weights-only
        --load is the base, and the log says so rather than that the optimizer starts fresh).
    Raises:
        CheckpointError: the checkpoint cannot be read, or its schedule contradicts the flags."""
    ckpt = ckpt or config.checkpoint
    state, schedule = TrainState(), config.optimizer.schedule
    if ckpt.load is None:
        return state, schedule
    with watchdog.watch(f"checkpoint I/O: loading {ckpt.load}", 60 * ckpt.timeout_minutes):
        meta = load_checkpoint(step, ckpt, layout(config.parallel, config.zero.stage),
                               config.runtime.device_type)
    if meta is not None and RESHARDED in meta:
        writer.write_text(meta[RESHARDED])
    if meta is None:
        writer.write_text(f"no checkpoint in {ckpt.load}: starting from scratch")
    elif not resumes_schedule(meta, ckpt.finetune) and base_of is not None:
        writer.write_text(f"loaded the base weights of {ckpt.load} iteration "
                          f"{meta['iteration']} (--finetune); the prompt-tuning run resumes "
                          f"from --save {base_of}")
    elif not resumes_schedule(meta, ckpt.finetune):
        how = "--finetune" if ckpt.finetune else "a weights-only checkpoint"
        writer.write_text(f"loaded the weights of {ckpt.load} iteration {meta['iteration']} "
                          f"({how}: optimizer, LR schedule and data start fresh)")
    else:
        state.iteration, state.consumed_samples = meta["iteration"], meta["consumed_samples"]
        try:
            schedule = resolve_with_checkpoint(schedule, meta["lr_schedule"], ckpt.lr_policy)
        except ValueError as e:
            raise CheckpointError(f"--load {ckpt.load}: {e}") from None
        converted = "; converted to this layout: the random generators start afresh" \
            if meta.get("format") == "weights" or RESHARDED in meta else ""
        writer.write_text(f"resumed from {ckpt.load} at iteration {state.iteration} "
                          f"({state.consumed_samples} samples consumed{converted})")
    if meta is not None and meta.get("format") != "weights" and MANIFEST not in meta:
        writer.write_text(f"note: {ckpt.load} iteration {meta['iteration']} was saved before "
                          f"checkpoints recorded their file sizes: its files were checked for "
                          f"presence only")
    return state, schedule


def _prompt_resume(config: RunConfig):
    """A prompt-tuning run requeued with its command line (--load BASE --finetune ... --save
    P, P holding its checkpoints): the settings that load P's latest checkpoint as a resume
    (the prompt, or the model and the prompt, their optimizer states, iteration, samples, LR
    schedule and random states), over the base loaded from --load."""
    return dataclasses.replace(config.checkpoint, load=config.checkpoint.save, finetune=False,
                               no_load_optim=False, no_load_rng=False, ckpt_step=None)


def _start_prompt(step, config: RunConfig, writer: MetricsWriter, resumed=None):
    """Prompt tuning: the prompt started once the base model is loaded, or left to the resume
    from --save that follows (`resumed`: what --save's checkpoint is, `_prompt_resume`); the
    base's identity (None without --prompt-tune)."""
    settings = prompt_settings(config.flags)
    if settings is None:
        return None
    from megatron.data.tokenizers.tokenizer import build_tokenizer
    from megatron.checkpoint.io.remote import is_remote, load_staging_root
    from megatron.training.prompt_tuning import init_token_id, start_prompt

    token = init_token_id(settings, build_tokenizer(config.data.tokenizer))
    load = Path(config.checkpoint.load) if config.checkpoint.load else None
    if load is not None and is_remote(config.checkpoint.load):  # what the load staged here
        load = load_staging_root(config.checkpoint.storage, config.checkpoint.load)
    iteration = load_iteration(load, config.checkpoint.ckpt_step) if load is not None else None
    try:  # (the load has read it already: a folder changed since)
        meta = read_meta(load / tag_for(iteration)) if iteration is not None else {}
        kind = kind_of(meta) if meta else CheckpointKind()
    except CheckpointReadError as e:
        raise CheckpointError(str(e)) from None
    loaded = kind.prompt is not None
    if loaded and not config.checkpoint.finetune:  # --load resumed a second stage's own run:
        identity = kind.prompt_base  # its base stays the one it records
        writer.write_text(f"prompt tuning: {settings.layout.length} vectors as --load "
                          f"{config.checkpoint.load} holds them (resumed); base "
                          f"{identity['load']} digest {identity['digest'][:12]}")
        return identity
    resume = None if resumed is None else (config.checkpoint.save, resumed.prompt_base)
    identity = start_prompt(step.engine, settings, token, config.checkpoint.load,
                            meta.get("iteration"), loaded, resume, config.checkpoint.storage)
    source = f"--save {config.checkpoint.save} (resumed below)" if resume else \
        f"--prompt-load {settings.load}" if settings.load else "--load" if loaded else \
        ("random" if token is None else f"token id {token}")
    writer.write_text(f"prompt tuning: {settings.layout.length} vectors "
                      f"({'/'.join(map(str, settings.layout.counts()))} front to back) from "
                      f"{source}; base {config.checkpoint.load} digest "
                      f"{identity['digest'][:12]}")
    return identity


def _saver(step, config: RunConfig, writer: MetricsWriter, watchdog,
           prompt_base=None) -> Saver:
    """The saver of --save, saying in the log what each save cost."""
    ckpt = config.checkpoint
    model_meta = {"config": config.model.t5.to_dict(),
                  "make_vocab_size_divisible_by": config.model.make_vocab_size_divisible_by,
                  "precision": config.precision.precision}
    t5, kind = config.model.t5, CheckpointKind()
    if prompt_base is not None:  # and the prompt's layout, for generation (megatron/generate.py)
        settings = prompt_settings(config.flags)
        kind = CheckpointKind(PROMPT_WITH_MODEL if settings.train_model else PROMPT_ALONE,
                              settings.layout, prompt_base)
    kind = dataclasses.replace(kind, router_type=t5.router_type if t5.is_moe else None)
    if config.parallel.pipeline_model_parallel_size > 1:
        model_meta["pipeline_blocks"] = list(config.pipeline_cut().blocks)
    remote = {"storage": ckpt.storage} if is_remote(ckpt.save) else {}
    saver = (RemoteSaver if remote else Saver)(
        step, ckpt.save, layout(config.parallel, config.zero.stage), config.runtime.device_type,
        config.flags, model_meta, ckpt.keep_last, ckpt.async_save, 60 * ckpt.timeout_minutes,
        watchdog, kind, **remote)
    saver.on_commit = lambda path, t: writer.write_text(
        f"saved checkpoint {path} ({t['bytes'] / 2**20:.1f} MiB; the step was held "
        f"{t['blocked_s']:.2f} s" + (f" + {t['waited_s']:.2f} s waiting for the previous "
                                     f"save" if t['waited_s'] >= 0.01 else "")
        + f"; state taken in {t['capture_s']:.2f} s"
        + f"; written in {t['written_s']:.2f} s per rank"
        + (" in the background" if t["async"] else "")
        + ("; committed once the next step passed the divergence checks"
           if t["held"] else "") + ")")
    saver.on_warning = writer.write_text
    return saver


def _final_evaluation(step, config: RunConfig, state: TrainState, writer: MetricsWriter,
                      watchdog, valid_loader, test_loader) -> None:
    tokenizer = functools.lru_cache(maxsize=None)(lambda: run_tokenizer(config))
    for split, loader in (("valid", valid_loader), ("test", test_loader)):
        evaluate_and_log(step, config.batch, config.runtime, loader, split, state, writer,
                         tokenizer, watchdog, accuracy_name(config))
    generation = validation_generation(step, config, valid_loader, watchdog)  # fine-tuning
    if generation:
        writer.write_text(generation_line(state.iteration, generation))
        writer.write_scalars(generation_scalars(generation), state.iteration)


def _plot(config: RunConfig, writer: MetricsWriter) -> None:
    # imported here: the figures need matplotlib, an optional dependency ('t5-pretrain[plot]')
    from megatron.plot.at_end import plot_at_end

    plot_at_end(config.checkpoint.save, config.logging.log_file,
                config.logging.tensorboard_dir, writer.write_text)


def _take_save_lock(save: str, device):
    """Rank 0 takes --save's writer lock (megatron/checkpoint/io/ownership.py); every rank learns
    whether it did. Returns the lock on rank 0, None elsewhere.

    Raises:
        CheckpointError: another live job holds the folder (on every rank)."""
    lock, problem = None, ""
    if dist.get_rank() == 0:
        try:
            lock = SaveLock(save).acquire()
        except (SaveLockError, OSError) as e:
            problem = str(e)
    failed = torch.tensor([float(bool(problem))], device=device)
    dist.all_reduce(failed)
    if failed.item():
        raise CheckpointError(problem or f"--save {save}: rank 0 could not take the folder's "
                                         f"writer lock (see its message)")
    return lock


def main(argv: Optional[Sequence[str]] = None, listeners: Sequence = ()) -> int:
    """The command line's run; `listeners`: timing listeners of its named ranges (a tool that
    starts the trainer in its own process, megatron/training/timing.py). The exit status."""
    # Before anything slow: a stop signal during start-up ends the run at its first step.
    with StopSignals() as signals:
        try:
            config = parse_args(argv)
        except ArgumentsError as e:
            said = speak_for_the_job([f"the command line cannot run:\n{e}"], os.environ,
                                     lambda: signals.received is not None)
            if said is not None:  # a requeued run's log says why it stopped
                append_to_log(e.log_file, said, only_if_exists=True)
            return EXIT_USAGE
        if config.dry_run:
            return print_dry_run(config)
        return run(config, signals, listeners)


def run(config: RunConfig, signals, listeners: Sequence = ()) -> int:
    """Join the job, train, leave the process group (without it, gloo jobs abort at interpreter
    exit now and then)."""
    runtime = config.runtime
    watch_launcher()  # under torchrun: end with the launcher, never outlive it
    launch = distributed_env(os.environ, runtime.local_rank)
    watchdog = Watchdog(int(launch["RANK"]))
    try:
        try:
            with watchdog.watch(f"process-group start: rendezvous with {launch['MASTER_ADDR']}:"
                                f"{launch['MASTER_PORT']} and connections to the other ranks "
                                f"(on hosts with several interfaces, set GLOO_SOCKET_IFNAME or "
                                f"NCCL_SOCKET_IFNAME)", 60 * runtime.distributed_timeout_minutes):
                created = join_process_group(runtime, config.parallel)
        except PortInUse as e:  # only the rank that binds it (0) finds it; its peers time out
            print(f"error: {e}", file=sys.stderr, flush=True)
            return 2
        return _train(config, signals, watchdog, created, listeners)
    finally:
        reap_daemonic_children()  # a data worker that nobody closed (training/data_workers.py)
        watchdog.close()


def peer_gone(error: BaseException) -> bool:
    """Whether a collective failed because another rank left (it failed or was stopped, and
    says why itself): no traceback of this rank adds anything."""
    backend_error = getattr(dist, "DistBackendError", None)
    if backend_error is not None and isinstance(error, backend_error):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and ("Connection closed by peer" in text
                                                or "Connection reset by peer" in text)


def _train(config: RunConfig, signals, watchdog, created: bool, listeners: Sequence) -> int:
    try:
        pretrain(config, signals, watchdog, listeners)  # ends with a barrier when it finished
    except RunFailure:  # pretrain reported it
        return 1
    except Exception as e:  # noqa: BLE001 - a bug keeps its traceback (re-raised below)
        if getattr(e, "_phase_reported", False) and peer_gone(e):
            return 1  # the watchdog's line named the phase; the peer's own report says why
        raise
    finally:
        parallel_state.destroy_model_parallel()
        if created and dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
