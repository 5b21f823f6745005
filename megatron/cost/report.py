"""What `--dry-run` prints: parameter counts and the memory estimate of one rank (per pipeline
stage with a pipeline), for the device `--dry-run-device` names; nothing is allocated."""

from __future__ import annotations

from megatron.config import RunConfig
from megatron.cost.memory import estimate_run, estimate_stages, stage_parameter_numels
from megatron.model.meta import count_parameters, num_parameters
from megatron.pipeline.partition import bubble_fraction


def print_dry_run(config: RunConfig) -> int:
    """Print what one rank would hold; nothing is allocated."""
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
