"""Pretrain a T5 / CPM-2 encoder-decoder: `torchrun --nproc_per_node N -m megatron.pretrain_t5 ...`.

Also runs under `srun` (one task per device), `python -m torch.distributed.launch`, the
`deepspeed` launcher, or as a plain `python -m megatron.pretrain_t5` (one process). Every flag is
checked before anything starts (see megatron/arguments.py); `--dry-run` stops after the checks
with parameter counts and a per-rank memory estimate. Exit status: 0 done (or stopped by an exit
condition after saving), 2 bad command line, 1 a failure while running.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from megatron import parallel_state
from megatron.arguments import ArgumentsError, args_to_dict, parse_args


def collate_tensors(samples: List[Dict[str, np.ndarray]]) -> Dict[str, torch.Tensor]:
    from megatron.data.t5_dataset import collate

    return {k: torch.from_numpy(v) for k, v in collate(samples).items()}


def build_data(args: argparse.Namespace, consumed_samples: int):
    """(train, valid, test) data loaders for this data-parallel rank (None for an empty split)."""
    from megatron.data.builder import build_datasets
    from megatron.data.data_args import data_config_from_args, sample_counts_from_args
    from megatron.data.samplers import PretrainingSampler
    from megatron.data.t5_dataset import T5SpecialTokens
    from megatron.data.tokenizer import T5Tokenizer

    tokenizer = T5Tokenizer(args.tokenizer_model, extra_ids=args.vocab_extra_ids)
    tokens = T5SpecialTokens.from_tokenizer(tokenizer, whole_word=args.whole_word_masking)
    datasets = build_datasets(data_config_from_args(args), tokens, sample_counts_from_args(args))
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    loaders = []
    for name in ("train", "valid", "test"):
        dataset = datasets.get(name)
        if dataset is None:
            loaders.append(None)
            continue
        sampler = PretrainingSampler(len(dataset), consumed_samples if name == "train" else 0,
                                     args.micro_batch_size, dp_rank, dp_size, drop_last=True)
        # Its own generator: a loader draws a seed from the default one at every iter(), which
        # would shift the dropout masks after a resume or an evaluation.
        loaders.append(torch.utils.data.DataLoader(
            dataset, batch_sampler=sampler, collate_fn=collate_tensors,
            generator=torch.Generator().manual_seed(args.seed),
            num_workers=args.num_workers, pin_memory=args.device_type == "cuda",
            persistent_workers=args.num_workers > 0 and name != "train"))
    return tuple(loaders)


def dry_run(args: argparse.Namespace) -> int:
    """Print what one rank would hold; nothing is allocated."""
    from megatron.training.memory import ZeroBuckets, count_parameters, estimate_memory

    tp = args.tensor_model_parallel_size
    device = args.device_type if args.dry_run_device == "auto" else args.dry_run_device
    total = args.model.num_parameters(args.make_vocab_size_divisible_by, tp)
    per_rank = count_parameters(args.model, tp, args.make_vocab_size_divisible_by)
    estimate = estimate_memory(
        args.model, tensor_parallel_size=tp, data_parallel_size=args.data_parallel_size,
        zero_stage=args.zero_stage, precision=args.precision,
        offload_optimizer=args.offload_optimizer, offload_param=args.offload_param,
        micro_batch_size=args.micro_batch_size, encoder_seq_length=args.encoder_seq_length,
        decoder_seq_length=args.decoder_seq_length,
        checkpoint_activations=args.checkpoint_activations,
        checkpoint_num_layers=args.checkpoint_num_layers,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        attention_kernel="fused" if device == "cuda" else "eager",
        buckets=ZeroBuckets.from_zero_config(args.ds_config.get("zero_optimization", {})),
        device_type=device,
        gradient_accumulation_steps=args.gradient_accumulation_steps)
    print(f"dry run: the flags and files are valid for {args.world_size} processes "
          f"(TP {tp} x PP {args.pipeline_model_parallel_size} x DP {args.data_parallel_size})")
    print(f"parameters: {total:,} in the model (padded vocabulary), {per_rank:,} per tensor "
          f"rank")
    print(f"batch: micro {args.micro_batch_size} x DP {args.data_parallel_size} x accumulation "
          f"{args.gradient_accumulation_steps} = global {args.global_batch_size}; "
          f"{args.train_iters} steps; precision {args.precision}; ZeRO {args.zero_stage}")
    print(f"memory per rank, estimated for {device} (--dry-run-device):")
    for line in estimate.table():
        print("  " + line)
    return 0


def pretrain(args: argparse.Namespace, signals=None, watchdog=None):
    """Train with validated args on an initialized process group; returns the TrainState.

    signals: a StopSignals already installed by the caller (main installs one before anything
    slow starts, so that a signal during start-up stops the run at its first step boundary).
    watchdog: the caller's (main starts one before the process group); else one of its own.
    """
    from megatron.initialize import set_seeds
    from megatron.training.checkpointing import CheckpointError, load_checkpoint, save_checkpoint
    from megatron.training.engine import build_model, count_parameters, initialize_engine
    from megatron.training.loop import TrainState, evaluate, train
    from megatron.training.lr_schedule import resolve_with_checkpoint
    from megatron.training.metrics import MetricsWriter
    from megatron.training.signals import StopSignals
    from megatron.training.watchdog import Watchdog

    rank = dist.get_rank()
    writer = MetricsWriter(args.log_file, args.tensorboard_dir, enabled=rank == 0,
                           train_iters=args.train_iters)
    own_watchdog = watchdog is None
    watchdog = watchdog or Watchdog(rank)
    collective_s = 60 * args.distributed_timeout_minutes
    try:
        for warning in args.warnings:
            writer.write_text(f"warning: {warning}")
        writer.write_text("flags: " + json.dumps(args_to_dict(args), sort_keys=True))
        writer.write_text("deepspeed config: " + json.dumps(args.ds_config, sort_keys=True))
        set_seeds(args.seed, args.device_type)
        with watchdog.watch("building the model (ZeRO-3 partitions it with the other ranks)",
                            collective_s):
            model = build_model(args)
        writer.write_text(f"parameters on tensor rank 0: {count_parameters(model):,}")
        with watchdog.watch("engine setup (DeepSpeed broadcasts and partitions the weights "
                            "with the other ranks)", collective_s):
            engine, _ = initialize_engine(args, model)
        schedule = args.lr_schedule
        state = TrainState()
        if args.load is not None:
            with watchdog.watch(f"checkpoint I/O: loading {args.load}",
                                60 * args.checkpoint_timeout_minutes):
                meta = load_checkpoint(engine, args)
            if meta is None:
                writer.write_text(f"no checkpoint in {args.load}: starting from scratch")
            elif args.finetune:
                writer.write_text(f"loaded the weights of {args.load} iteration "
                                  f"{meta['iteration']} (--finetune)")
            else:
                state.iteration, state.consumed_samples = meta["iteration"], \
                    meta["consumed_samples"]
                try:
                    schedule = resolve_with_checkpoint(schedule, meta["lr_schedule"],
                                                       args.lr_policy)
                except ValueError as e:
                    raise CheckpointError(f"--load {args.load}: {e}") from None
                writer.write_text(f"resumed from {args.load} at iteration {state.iteration} "
                                  f"({state.consumed_samples} samples consumed)")
        with watchdog.watch("data: building the datasets (index caches; another rank may be "
                            "building them)", args.data_cache_timeout + 60):
            train_loader, valid_loader, test_loader = build_data(args, state.consumed_samples)
        if train_loader is None:
            raise RuntimeError("the train split is empty: check --split and --data-path")

        def save(s: TrainState) -> None:
            path = save_checkpoint(engine, args, s.iteration, s.consumed_samples,
                                   schedule.state_dict(), args_to_dict(args))
            writer.write_text(f"saved checkpoint {path}")

        if state.iteration < args.train_iters:
            with contextlib.ExitStack() as stack:
                if signals is None:
                    signals = stack.enter_context(StopSignals())
                state = train(args, engine, schedule, train_loader, valid_loader, writer, state,
                              save, signals, watchdog)
        if not state.exit_reason:
            for split, loader in (("valid", valid_loader), ("test", test_loader)):
                loss = evaluate(engine, args, loader, watchdog)
                if loss is not None:
                    state.evaluations.append((state.iteration, split, loss))
                    writer.write_eval(state.iteration, split, loss)
        return state
    finally:
        if own_watchdog:
            watchdog.close()
        writer.close()


def main(argv: Optional[Sequence[str]] = None) -> int:
    from megatron.training.signals import StopSignals

    # Before anything slow: a stop signal during start-up ends the run at its first step.
    with StopSignals() as signals:
        try:
            args = parse_args(argv)
        except ArgumentsError as e:
            print(f"error: the command line cannot run:\n{e}", file=sys.stderr)
            return 2
        if args.dry_run:
            return dry_run(args)
        return run(args, signals)


def run(args: argparse.Namespace, signals) -> int:
    """Join the job, train, leave the process group (without it, gloo jobs abort at interpreter
    exit now and then)."""
    from megatron.initialize import distributed_env, initialize_distributed
    from megatron.training.checkpointing import CheckpointError
    from megatron.training.watchdog import Watchdog

    launch = distributed_env(os.environ, args.local_rank)
    watchdog = Watchdog(int(launch["RANK"]))
    try:
        with watchdog.watch(f"process-group start: rendezvous with {launch['MASTER_ADDR']}:"
                            f"{launch['MASTER_PORT']} and connections to the other ranks (on "
                            f"hosts with several interfaces, set GLOO_SOCKET_IFNAME or "
                            f"NCCL_SOCKET_IFNAME)",
                            # + 5 minutes: DeepSpeed may compile its communication op first
                            60 * args.distributed_timeout_minutes + 300):
            created = initialize_distributed(args)
        return _train(args, signals, watchdog, created, CheckpointError)
    finally:
        watchdog.close()


def _train(args, signals, watchdog, created: bool, CheckpointError) -> int:
    finished = False
    try:
        pretrain(args, signals, watchdog)
        finished = True
    except CheckpointError as e:
        print(f"error (rank {dist.get_rank()}): {e}", file=sys.stderr)
        return 1
    finally:
        parallel_state.destroy_model_parallel()
        if created and dist.is_initialized():
            if finished:  # a failed rank's peers may be gone: no barrier then
                with watchdog.watch("collective: the barrier before leaving",
                                    60 * args.distributed_timeout_minutes):
                    dist.barrier()
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
