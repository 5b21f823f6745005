"""Pretrain a T5 / CPM-2 encoder-decoder: `torchrun --nproc_per_node N -m megatron.pretrain_t5 ...`.

Also runs under `srun` (one task per device), `python -m torch.distributed.launch`, the
`deepspeed` launcher, or as a plain `python -m megatron.pretrain_t5` (one process). Every flag is
checked before anything starts (see megatron/arguments.py); `--dry-run` stops after the checks
with parameter counts and a per-rank memory estimate. Exit status: 0 done (or stopped by an exit
condition after saving), 2 bad command line, 1 a failure while running.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import socket
import sys
from typing import Dict, List, Mapping, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from megatron import parallel_state
from megatron.arguments import ArgumentsError, parse_args
from megatron.config import RunConfig
from megatron.data.data_args import DataSettings
from megatron.config.training import BatchConfig


def collate_tensors(samples: List[Dict[str, np.ndarray]]) -> Dict[str, torch.Tensor]:
    from megatron.data.t5_dataset import collate

    return {k: torch.from_numpy(v) for k, v in collate(samples).items()}


def build_data(data: DataSettings, batch: BatchConfig, device_type: str,
               consumed_samples: int, reads_batches: bool = True):
    """(train, valid, test) data loaders for this data-parallel rank (None for an empty split).

    reads_batches: False on a pipeline stage that reads no batch (neither the first nor the
    last): its loaders hold as many placeholder batches as the others' and load nothing.
    """
    from megatron.data.builder import build_datasets, split_sample_counts
    from megatron.data.samplers import PretrainingSampler
    from megatron.data.t5_dataset import T5SpecialTokens
    from megatron.data.tokenizer import build_tokenizer
    from megatron.training.signals import data_worker_init

    tokenizer = build_tokenizer(data.tokenizer, extra_ids=data.vocab_extra_ids)
    tokens = T5SpecialTokens.from_tokenizer(tokenizer, whole_word=data.dataset.t5.whole_word)
    counts = split_sample_counts(batch.train_iters, batch.global_batch_size, batch.eval_interval,
                                 batch.eval_iters)
    datasets = build_datasets(data.dataset, tokens, counts)
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    loaders = []
    for name in ("train", "valid", "test"):
        dataset = datasets.get(name)
        if dataset is None:
            loaders.append(None)
            continue
        sampler = PretrainingSampler(len(dataset), consumed_samples if name == "train" else 0,
                                     batch.micro_batch_size, dp_rank, dp_size, drop_last=True)
        if not reads_batches:
            loaders.append(UnreadBatches(len(sampler)))
            continue
        # Its own generator: a loader draws a seed from the default one at every iter(), which
        # would shift the dropout masks after a resume or an evaluation.
        loaders.append(torch.utils.data.DataLoader(
            dataset, batch_sampler=sampler, collate_fn=collate_tensors,
            generator=torch.Generator().manual_seed(data.seed),
            num_workers=data.num_workers, pin_memory=device_type == "cuda",
            persistent_workers=data.num_workers > 0 and name != "train",
            worker_init_fn=functools.partial(data_worker_init, rank_pid=os.getpid())
            if data.num_workers > 0 else None))
    return tuple(loaders)


class UnreadBatches:
    """A loader's stand-in on a pipeline stage that reads no batch: as many (empty) batches as
    the loader of the stages that do, so that every stage runs the same number of steps and
    evaluation steps."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __iter__(self):
        return itertools.repeat({}, self.length)


def dry_run(config: RunConfig) -> int:
    """Print what one rank would hold; nothing is allocated."""
    from megatron.model.meta import count_parameters, num_parameters
    from megatron.cost.memory import estimate_run

    parallel, model, batch = config.parallel, config.model, config.batch
    tp = parallel.tensor_model_parallel_size
    device = config.runtime.device_type if config.dry_run_device == "auto" \
        else config.dry_run_device
    total = num_parameters(model.t5, model.make_vocab_size_divisible_by, tp)
    per_rank = count_parameters(model.t5, tp, model.make_vocab_size_divisible_by)
    estimate = estimate_run(config.layout(), device)
    print(f"dry run: the flags and files are valid for {parallel.world_size} processes "
          f"(TP {tp} x PP {parallel.pipeline_model_parallel_size} x DP "
          f"{parallel.data_parallel_size})")
    print(f"parameters: {total:,} in the model (padded vocabulary), {per_rank:,} per tensor "
          f"rank")
    print(f"batch: micro {batch.micro_batch_size} x DP {parallel.data_parallel_size} x "
          f"accumulation {batch.gradient_accumulation_steps} = global "
          f"{batch.global_batch_size}; {batch.train_iters} steps; precision "
          f"{config.precision.precision}; ZeRO {config.zero.stage}")
    if parallel.pipeline_model_parallel_size == 1:
        print(f"memory per rank, estimated for {device} (--dry-run-device):")
        for line in estimate.table():
            print("  " + line)
        return 0
    _print_pipeline(config, device)
    return 0


def _print_pipeline(config: RunConfig, device: str) -> None:
    """--dry-run with P > 1: the cut, the bubble, parameters and memory per stage."""
    from megatron.pipeline.partition import bubble_fraction
    from megatron.cost.memory import estimate_stages, stage_parameter_numels

    model, p = config.model, config.parallel.pipeline_model_parallel_size
    m = config.batch.gradient_accumulation_steps
    cut = config.pipeline_cut()
    for line in cut.describe():
        print(line)
    print(f"pipeline bubble: {100 * bubble_fraction(p, m):.1f}% of a step idle under 1F1B "
          f"((P - 1) / (m + P - 1) = {p - 1} / {m + p - 1}; m = {m} micro-batches per step)")
    print(f"memory per rank, estimated for {device} (--dry-run-device), by pipeline stage "
          f"(GiB; parameters per tensor rank, tied copies on each stage holding one):")
    print(f"  {'stage':>5} {'parameters':>15} {'in flight':>9} {'params':>8} {'grads':>8} "
          f"{'optimizer':>9} {'activations':>11} {'buffers':>8} {'send/recv':>9} {'total':>8} "
          f"{'offloaded':>9}")
    stages = estimate_stages(config.layout(), device)
    gib = 2 ** 30
    for s, est in enumerate(stages):
        count = sum(stage_parameter_numels(model.t5, cut, s, config.parallel.
                                           tensor_model_parallel_size,
                                           model.make_vocab_size_divisible_by).values())
        print(f"  {s:>5} {count:>15,} {est.in_flight:>9} {est.parameters / gib:>8.3f} "
              f"{est.gradients / gib:>8.3f} {est.optimizer_states / gib:>9.3f} "
              f"{est.activations / gib:>11.3f} {est.buffers / gib:>8.3f} "
              f"{est.pipeline_buffers / gib:>9.3f} {est.total / gib:>8.3f} "
              f"{est.offloaded / gib:>9.3f}")
    worst = max(range(len(stages)), key=lambda s: stages[s].total)
    print(f"  largest: stage {worst}, {stages[worst].total / gib:.3f} GiB on device per rank")


def build_step(config: RunConfig, watchdog, writer):
    """The training step for this layout: DeepSpeed's pipeline engine with P > 1, else its
    data-parallel engine (both with tensor parallelism)."""
    from megatron.training.engine import build_model, count_parameters, initialize_engine
    from megatron.training.step import DataParallelStep

    if config.parallel.pipeline_model_parallel_size > 1:
        from megatron.training.pipeline_step import build_pipeline_step

        return build_pipeline_step(config, watchdog, writer)
    runtime = config.runtime
    collective_s = 60 * runtime.distributed_timeout_minutes
    with watchdog.watch("building the model (ZeRO-3 partitions it with the other ranks)",
                        collective_s):
        model = build_model(config.model, config.zero, runtime.torch_device(),
                            config.deepspeed_json())
    writer.write_text(f"parameters on tensor rank 0: {count_parameters(model):,}")
    with watchdog.watch("engine setup (DeepSpeed broadcasts and partitions the weights "
                        "with the other ranks)", collective_s):
        engine, _ = initialize_engine(config.optimizer, config.zero, runtime.device_type,
                                      config.deepspeed_json(), model)
    return DataParallelStep(engine, runtime.torch_device())


def step_cost(config: RunConfig):
    """Model FLOPs of a global batch and the device's peak, for the metrics line."""
    from megatron.model.flops import training_step_flops
    from megatron.training.loop import StepCost
    from megatron.training.metrics import peak_tflops

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


def pretrain(config: RunConfig, signals=None, watchdog=None):
    """Train with a validated config on an initialized process group; returns the TrainState.

    signals: a StopSignals already installed by the caller (main installs one before anything
    slow starts, so that a signal during start-up stops the run at its first step boundary).
    watchdog: the caller's (main starts one before the process group); else one of its own.

    First, before anything costly or visible, rank 0 takes --save's writer lock and every rank
    learns the verdict; only then does DeepSpeed start (it builds or loads a compiled op).

    Raises:
        RunFailure (megatron/failures.py), after reporting it once.
    """
    from megatron.initialize import join_deepspeed
    from megatron.failures import RunFailure, report_failure
    from megatron.training.watchdog import Watchdog

    runtime = config.runtime
    own_watchdog = watchdog is None
    watchdog = watchdog or Watchdog(dist.get_rank())
    lock = None
    try:
        if config.checkpoint.save is not None:
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
        return _pretrain(config, signals, watchdog, lock)
    except RunFailure as e:
        report_failure(e, dist.get_rank(), config.logging.log_file)
        raise
    finally:
        if lock is not None:
            lock.release()
        if own_watchdog:
            watchdog.close()


def _pretrain(config: RunConfig, signals, watchdog, lock):
    """pretrain's body, holding --save's lock (None without --save, or on ranks other than 0)."""
    from megatron.initialize import set_seeds
    from megatron.checkpoint.io.checkpointing import CheckpointError, layout, load_checkpoint, \
        resumes_schedule
    from megatron.failures import DataError
    from megatron.checkpoint.io.saver import Saver
    from megatron.training.loop import TrainState, evaluate, train
    from megatron.config.lr_schedule import resolve_with_checkpoint
    from megatron.training.metrics import MetricsWriter
    from megatron.checkpoint.io.ownership import describe
    from megatron.training.profiling import StepProfiler
    from megatron.training.signals import StopSignals

    rank = dist.get_rank()
    runtime, ckpt, batch = config.runtime, config.checkpoint, config.batch
    writer = MetricsWriter(config.logging.log_file, config.logging.tensorboard_dir,
                           enabled=rank == 0, train_iters=batch.train_iters)
    parallel = config.parallel
    if parallel.model_parallel_size > 1:
        watchdog.place = (f" (pipeline stage {parallel_state.get_pipeline_model_parallel_rank()}"
                          f" of {parallel.pipeline_model_parallel_size}, tensor rank "
                          f"{parallel_state.get_tensor_model_parallel_rank()}, data-parallel "
                          f"rank {parallel_state.get_data_parallel_rank()})")
    layout_now = layout(config.parallel, config.zero.stage)
    saver = None
    profiler = StepProfiler(config.profile, rank, runtime.device_type,
                            writer.write_text if rank == 0 else print)
    try:
        for warning in runtime.warnings:
            writer.write_text(f"warning: {warning}")
        writer.write_text("flags: " + json.dumps(config.flags, sort_keys=True))
        writer.write_text("deepspeed config: " + json.dumps(config.deepspeed, sort_keys=True))
        if lock is not None and lock.took_over is not None:
            writer.write_text(f"warning: --save {ckpt.save}: took over the writer lock of a job "
                              f"that is gone ({describe(lock.took_over)})")
        set_seeds(runtime.seed, runtime.device_type)
        step = build_step(config, watchdog, writer)
        profiler.instrument(step)
        if config.logging.grad_norms_per_layer:
            from megatron.training.layer_norms import layer_groups

            t5 = config.model.t5
            step.watch_layer_grad_norms(layer_groups(t5.num_layers, t5.num_decoder_layers,
                                                     t5.tie_word_embeddings))
        if ckpt.check_for_nan:
            step.watch_nonfinite(ckpt.detect_nan_layers)
        schedule = config.optimizer.schedule
        state = TrainState()
        if ckpt.load is not None:
            with watchdog.watch(f"checkpoint I/O: loading {ckpt.load}",
                                60 * ckpt.timeout_minutes):
                meta = load_checkpoint(step, ckpt, layout_now, runtime.device_type)
            if meta is None:
                writer.write_text(f"no checkpoint in {ckpt.load}: starting from scratch")
            elif not resumes_schedule(meta, ckpt.finetune):
                how = "--finetune" if ckpt.finetune else "a weights-only checkpoint"
                writer.write_text(f"loaded the weights of {ckpt.load} iteration "
                                  f"{meta['iteration']} ({how}: optimizer, LR schedule and "
                                  f"data start fresh)")
            else:
                state.iteration, state.consumed_samples = meta["iteration"], \
                    meta["consumed_samples"]
                try:
                    schedule = resolve_with_checkpoint(schedule, meta["lr_schedule"],
                                                       ckpt.lr_policy)
                except ValueError as e:
                    raise CheckpointError(f"--load {ckpt.load}: {e}") from None
                converted = "; converted to this layout: the random generators start afresh" \
                    if meta.get("format") == "weights" else ""
                writer.write_text(f"resumed from {ckpt.load} at iteration {state.iteration} "
                                  f"({state.consumed_samples} samples consumed{converted})")
        with watchdog.watch("data: building the datasets (index caches; another rank may be "
                            "building them)", runtime.data_cache_timeout_s + 60):
            train_loader, valid_loader, test_loader = build_data(
                config.data, batch, runtime.device_type, state.consumed_samples,
                parallel_state.is_pipeline_first_stage() or
                parallel_state.is_pipeline_last_stage())
        if train_loader is None:
            raise DataError("the train split is empty: check --split and --data-path")

        model_meta = {"config": config.model.t5.to_dict(),
                      "make_vocab_size_divisible_by": config.model.make_vocab_size_divisible_by,
                      "precision": config.precision.precision}
        if config.parallel.pipeline_model_parallel_size > 1:
            model_meta["pipeline_blocks"] = list(config.pipeline_cut().blocks)

        if ckpt.save is not None:
            saver = Saver(step, ckpt.save, layout_now, runtime.device_type, config.flags,
                          model_meta, ckpt.keep_last, ckpt.async_save,
                          60 * ckpt.timeout_minutes, watchdog)
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

        def save(s: TrainState, hold: bool = False) -> None:
            if saver.save(s.iteration, s.consumed_samples, schedule.state_dict(),
                          hold) is None and saver.pending is not None:
                writer.write_text(f"saving checkpoint {s.iteration} in the background")

        if state.iteration < batch.train_iters:
            with contextlib.ExitStack() as stack:
                if signals is None:
                    signals = stack.enter_context(StopSignals())
                state = train(step, batch, config.logging, ckpt, runtime, step_cost(config),
                              schedule, train_loader, valid_loader, writer, state, save,
                              signals, watchdog, saver, profiler)
        if not state.exit_reason:
            for split, loader in (("valid", valid_loader), ("test", test_loader)):
                loss = evaluate(step, batch, runtime, loader, watchdog)
                if loss is not None:
                    state.evaluations.append((state.iteration, split, loss))
                    writer.write_eval(state.iteration, split, loss)
        if rank == 0 and ckpt.save is not None and config.logging.plots \
                and not state.exit_reason.startswith("signal"):
            # a signal's grace period is the scheduler's, not the figures'
            from megatron.plot.at_end import plot_at_end

            plot_at_end(ckpt.save, config.logging.log_file, config.logging.tensorboard_dir,
                        writer.write_text)
        return state
    finally:
        profiler.finish()  # a run that failed inside the window: the steps it recorded
        if saver is not None:
            saver.close()
        writer.close()


def _take_save_lock(save: str, device):
    """Rank 0 takes --save's writer lock (megatron/checkpoint/io/ownership.py); every rank learns
    whether it did. Returns the lock on rank 0, None elsewhere.

    Raises:
        CheckpointError: another live job holds the folder (on every rank)."""
    from megatron.checkpoint.io.checkpointing import CheckpointError
    from megatron.checkpoint.io.ownership import SaveLock, SaveLockError

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


def startup_voice(env: Mapping[str, str]) -> Optional[str]:
    """How this rank reports a command line that cannot run, found before any process group
    exists (so no rank can ask another): '' for rank 0, which speaks for the job; None (silent)
    for the other ranks of its node, which check the same flags and see the same files; and
    for the first rank of every other node a prefix naming the node, since a file may be
    missing there only."""
    rank = env.get("RANK", env.get("SLURM_PROCID", "0"))
    if rank == "0":
        return ""
    node = env.get("GROUP_RANK", env.get("SLURM_NODEID", env.get("NODE_RANK", "0")))
    local = env.get("LOCAL_RANK", env.get("SLURM_LOCALID", "0"))
    if node == "0" or local != "0":
        return None
    return f" (node {node}, {socket.gethostname()})"


def main(argv: Optional[Sequence[str]] = None) -> int:
    from megatron.training.signals import StopSignals

    # Before anything slow: a stop signal during start-up ends the run at its first step.
    with StopSignals() as signals:
        try:
            config = parse_args(argv)
        except ArgumentsError as e:
            voice = startup_voice(os.environ)
            if voice is not None:
                print(f"error{voice}: the command line cannot run:\n{e}", file=sys.stderr)
            return 2
        if config.dry_run:
            return dry_run(config)
        return run(config, signals)


def run(config: RunConfig, signals) -> int:
    """Join the job, train, leave the process group (without it, gloo jobs abort at interpreter
    exit now and then)."""
    from megatron.initialize import distributed_env, join_process_group
    from megatron.checkpoint.io.ownership import watch_launcher
    from megatron.training.watchdog import Watchdog

    runtime = config.runtime
    watch_launcher()  # under torchrun: end with the launcher, never outlive it
    launch = distributed_env(os.environ, runtime.local_rank)
    watchdog = Watchdog(int(launch["RANK"]))
    try:
        with watchdog.watch(f"process-group start: rendezvous with {launch['MASTER_ADDR']}:"
                            f"{launch['MASTER_PORT']} and connections to the other ranks (on "
                            f"hosts with several interfaces, set GLOO_SOCKET_IFNAME or "
                            f"NCCL_SOCKET_IFNAME)", 60 * runtime.distributed_timeout_minutes):
            created = join_process_group(runtime, config.parallel)
        return _train(config, signals, watchdog, created)
    finally:
        watchdog.close()


def _train(config: RunConfig, signals, watchdog, created: bool) -> int:
    from megatron.failures import RunFailure

    finished = False
    try:
        pretrain(config, signals, watchdog)
        finished = True
    except RunFailure:  # pretrain reported it
        return 1
    finally:
        parallel_state.destroy_model_parallel()
        if created and dist.is_initialized():
            if finished:  # a failed rank's peers may be gone: no barrier then
                with watchdog.watch("collective: the barrier before leaving",
                                    60 * config.runtime.distributed_timeout_minutes):
                    dist.barrier()
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
