"""What `--dry-run` prints: parameter counts and the memory estimate of one rank (per pipeline
stage with a pipeline), for the device `--dry-run-device` names; nothing is allocated."""

from __future__ import annotations

from megatron.config import RunConfig
from megatron.config.prompt_args import prompt_settings
from megatron.cost.memory import estimate_run, estimate_stages, stage_parameter_numels
from megatron.model.meta import active_parameters, count_parameters, is_expert_parameter, \
    num_parameters, parameter_numels
from megatron.pipeline.partition import bubble_fraction


def print_dry_run(config: RunConfig) -> int:
    """Print what one rank would hold; nothing is allocated."""
    parallel, model, batch = config.parallel, config.model, config.batch
    tp = parallel.tensor_model_parallel_size
    device = config.runtime.device_type if config.dry_run_device == "auto" \
        else config.dry_run_device
    total = num_parameters(model.t5, model.make_vocab_size_divisible_by, tp)
    ep = parallel.expert_model_parallel_size
    per_rank = count_parameters(model.t5, tp, model.make_vocab_size_divisible_by, ep)
    prompt = prompt_settings(config.flags)
    prompt_length = prompt.layout.length if prompt is not None else 0
    frozen = prompt is not None and not prompt.train_model
    estimate = estimate_run(config.layout(), device, prompt_length=prompt_length,
                            frozen_model=frozen)
    print(f"dry run: the flags and files are valid for {parallel.world_size} processes "
          f"(TP {tp} x PP {parallel.pipeline_model_parallel_size} x DP "
          f"{parallel.data_parallel_size})")
    print(f"parameters: {total:,} in the model (padded vocabulary), {per_rank:,} per tensor "
          f"rank" + (f" (its experts: E / {ep} of each layer)" if ep > 1 else ""))
    print(f"batch: micro {batch.micro_batch_size} x DP {parallel.data_parallel_size} x "
          f"accumulation {batch.gradient_accumulation_steps} = global "
          f"{batch.global_batch_size}; {batch.train_iters} steps; precision "
          f"{config.precision.precision}; ZeRO {config.zero.stage}")
    if model.t5.is_moe:
        for line in moe_lines(config):
            print(line)
    ul2 = config.data.dataset.t5.ul2
    if ul2 is not None:
        print(ul2.describe_budget(config.data.encoder_seq_length, config.data.decoder_seq_length))
    if prompt is not None:
        print(f"prompt tuning: {prompt_length} vectors of {model.t5.d_model} in the encoder "
              f"input (+{prompt_length} positions)" + (
                  "; the model's parameters frozen: no gradients, optimizer states or ZeRO "
                  "partitions for them" if frozen else "; the model trains too"))
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
          f"(GiB; parameters per tensor rank, with its share of the experts; tied copies on "
          f"each stage holding one):")
    print(f"  {'stage':>5} {'parameters':>15} {'in flight':>9} {'params':>8} {'grads':>8} "
          f"{'optimizer':>9} {'activations':>11} {'buffers':>8} {'send/recv':>9} {'total':>8} "
          f"{'offloaded':>9}")
    stages = estimate_stages(config.layout(), device)
    gib = 2 ** 30
    for s, est in enumerate(stages):
        count = sum(stage_parameter_numels(
            model.t5, cut, s, config.parallel.tensor_model_parallel_size,
            model.make_vocab_size_divisible_by,
            config.parallel.expert_model_parallel_size).values())
        print(f"  {s:>5} {count:>15,} {est.in_flight:>9} {est.parameters / gib:>8.3f} "
              f"{est.gradients / gib:>8.3f} {est.optimizer_states / gib:>9.3f} "
              f"{est.activations / gib:>11.3f} {est.buffers / gib:>8.3f} "
              f"{est.pipeline_buffers / gib:>9.3f} {est.total / gib:>8.3f} "
              f"{est.offloaded / gib:>9.3f}")
    worst = max(range(len(stages)), key=lambda s: stages[s].total)
    print(f"  largest: stage {worst}, {stages[worst].total / gib:.3f} GiB on device per rank")


def all_to_all_bytes(config) -> int:
    """Bytes one rank sends by all-to-all in a training step: each sparse layer sends every
    token choice that leaves for another expert-parallel rank (on average (EP - 1) / EP of
    them, dropless) and receives as many back, in forward and again in backward (recomputation
    adds a forward's worth). config: a run's `Layout` (RunConfig.layout(), or the planner's)."""
    t5, parallel, batch = config.model.t5, config.parallel, config.batch
    ep = parallel.expert_model_parallel_size
    if ep == 1:
        return 0
    element = 4 if config.precision.precision == "fp32" else 2
    passes = 2 * 2 + (2 if config.model.checkpoint_activations else 0)  # out and back, fwd+bwd
    tokens = {False: config.encoder_seq_length, True: config.decoder_seq_length}
    per_micro = sum(len(t5.sparse_blocks(dec)) * batch.micro_batch_size * tokens[dec]
                    for dec in (False, True))
    return int(per_micro * t5.router_k * t5.d_model * element * passes * (ep - 1) / ep
               * batch.gradient_accumulation_steps)


def moe_lines(config: RunConfig):
    """--dry-run's Mixture-of-Experts lines: total and active parameters, the experts a rank
    holds and their memory, the all-to-all traffic of a step."""
    model, parallel = config.model, config.parallel
    t5, tp, ep = model.t5, parallel.tensor_model_parallel_size, \
        parallel.expert_model_parallel_size
    divisor = model.make_vocab_size_divisible_by
    numels = parameter_numels(t5, tp, divisor, ep)
    experts = sum(n for name, n in numels.items() if is_expert_parameter(name))
    sparse = len(t5.sparse_blocks(False)) + len(t5.sparse_blocks(True))
    element = 4 if config.precision.precision == "fp32" else 2
    yield (f"mixture of experts: {t5.num_experts} experts in {sparse} sparse blocks "
           f"({t5.router_type}, k = {t5.router_k}); parameters: "
           f"{num_parameters(t5, divisor, tp):,} in all, "
           f"{active_parameters(t5, divisor, tp):,} active per token (FLOPs and MFU count "
           "these)")
    yield (f"experts per rank: {t5.num_experts // ep} of each sparse layer (EP {ep}), "
           f"{experts:,} parameters per tensor rank ({experts * element / 2 ** 30:.3f} GiB of "
           f"weights; ZeRO partitions their gradients and optimizer states over the ranks "
           f"holding the same experts: {parallel.data_parallel_size // ep} of them)")
    if ep > 1:
        yield (f"all-to-all per step and rank: {all_to_all_bytes(config.layout()) / 2 ** 30:.3f} GiB "
               f"sent (and as much received) over the {ep} expert-parallel ranks")
