"""`--dry-run`: validation, parameter counts and the memory estimate, without a process group;
the launcher's local-rank spellings."""

import torch

from megatron.arguments import parse_args
from megatron.model import T5Config, T5Model
from megatron.pretrain_t5 import main
from train_workers import base_argv


def test_dry_run_prints_counts_and_estimate(train_data, capsys):
    assert main(base_argv(train_data, "--dry-run", "--zero-stage", "2")) == 0
    out = capsys.readouterr().out
    model = T5Model(T5Config.from_json(train_data.tiny), device="meta")
    count = sum(p.numel() for p in model.parameters())
    assert f"{count:,} in the model" in out
    assert "memory per rank, estimated for cpu" in out and "ZeRO 2" in out
    assert not torch.distributed.is_initialized()


def test_dry_run_plans_for_gpus_from_a_cpu_host(train_data, capsys):
    """The same flags, estimated for CUDA: DeepSpeed's reduce buckets are allocated whole
    there, so the GPU estimate holds more buffers than the CPU one."""
    from megatron.training.memory import ZeroBuckets

    argv = base_argv(train_data, "--dry-run", "--zero-stage", "2")
    assert main(argv) == 0
    cpu = capsys.readouterr().out
    assert main(argv + ["--dry-run-device", "cuda"]) == 0
    cuda = capsys.readouterr().out
    assert "estimated for cuda" in cuda

    def buffers(text):
        line = next(l for l in text.splitlines() if l.strip().startswith("buffers"))
        return float(line.split()[1])

    # 4 bytes x DeepSpeed's default reduce bucket of 5e8 elements, capped by the model size
    assert buffers(cuda) > buffers(cpu)
    assert ZeroBuckets().reduce_bucket_size == 500_000_000


def test_dry_run_plans_for_another_world_size(train_data, capsys):
    argv = base_argv(train_data, "--dry-run", "--tensor-model-parallel-size", "2",
                     "--global-batch-size", "16")
    config = parse_args(argv, env={"WORLD_SIZE": "8"})
    assert (config.parallel.data_parallel_size, config.batch.gradient_accumulation_steps) == \
        (4, 2)


def test_local_rank_spellings(train_data):
    for flag in ("--local_rank=1", "--local-rank=1", "--local_rank", "--local-rank"):
        extra = [flag] if "=" in flag else [flag, "1"]
        assert parse_args(base_argv(train_data, *extra), env={}).runtime.local_rank == 1
