"""`--dry-run`: validation, parameter counts and the memory estimate, without a process group;
with a pipeline the cut, the bubble and the numbers per stage; the launcher's local-rank
spellings."""

import json
import re

import pytest
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
    from megatron.cost.memory import ZeroBuckets

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


# A tied model of 4 + 4 blocks; on 8 processes with P = 4: DP 2, micro batch 2.
PIPE_MODEL = dict(vocab_size=4100, d_model=32, d_kv=8, d_ff=64, num_layers=4,
                  num_decoder_layers=4, num_heads=4, feed_forward_proj="gated-gelu",
                  tie_word_embeddings=True, dropout_rate=0.0)


def stage_rows(out):
    """{stage: (parameters, in flight, [GiB columns])} from the per-stage table."""
    lines = out.split("by pipeline stage")[1].splitlines()[2:]
    rows = {}
    for line in lines:
        cells = line.split()
        if not cells or not cells[0].isdigit():
            break
        rows[int(cells[0])] = (int(cells[1].replace(",", "")), int(cells[2]),
                               [float(c) for c in cells[3:]])
    return rows


@pytest.mark.parametrize("global_batch, split", [(16, None), (8, None), (16, 2)])
def test_dry_run_pipeline_prints_cut_bubble_and_stages(train_data, tmp_path, capsys,
                                                       monkeypatch, global_batch, split):
    """Parameters per stage by hand: the blocks a stage runs, each stack's bias table on every
    stage with its blocks, the final norms where the stacks end, the shared embedding on stage 0,
    on the first decoder stage and (tied) as the head on the last; together the model's count
    plus the tied copies. 1F1B: stage s holds min(P - s, m) micro-batches."""
    model = tmp_path / "tied.json"
    model.write_text(json.dumps(PIPE_MODEL))
    extra = [] if split is None else ["--pipeline-model-parallel-split-rank", str(split)]
    argv = base_argv(train_data, "--dry-run", "--dry-run-device", "cuda",
                     "--pipeline-model-parallel-size", "4", "--zero-stage", "1",
                     "--global-batch-size", str(global_batch), *extra, model=str(model))
    monkeypatch.setenv("WORLD_SIZE", "8")
    config = parse_args(argv)
    assert main(argv) == 0
    out = capsys.readouterr().out
    P, m = 4, global_batch // (2 * 2)
    assert "(TP 1 x PP 4 x DP 2)" in out
    assert len(re.findall(r"^  stage \d: ", out, re.M)) == P and "pipeline: 4 stages" in out
    assert f"{100 * (P - 1) / (m + P - 1):.1f}% of a step idle" in out
    assert f"= {P - 1} / {m + P - 1}; m = {m} micro-batches" in out

    d, inner, ff, vocab = 32, 32, 64, 4224  # 4100 padded to a multiple of 128
    encoder_block = 4 * d * inner + 3 * d * ff + 2 * d
    decoder_block = 8 * d * inner + 3 * d * ff + 3 * d
    bias, embedding = 32 * 4, vocab * d
    cut = config.pipeline_cut()
    rows = stage_rows(out)
    assert sorted(rows) == list(range(P))
    total = 0
    for s in range(P):
        enc, dec = cut.stage_blocks(s)
        first_decoder = len(dec) > 0 and dec.start == 0
        expected = len(enc) * encoder_block + len(dec) * decoder_block
        expected += bias * ((len(enc) > 0) + (len(dec) > 0))
        expected += embedding * (s == 0 or first_decoder or s == P - 1)
        expected += d * (len(enc) > 0 and enc.stop == 4) + d * (s == P - 1)
        parameters, in_flight, gib = rows[s]
        assert parameters == expected, s
        assert in_flight == min(P - s, m)
        # params, grads, optimizer, activations, buffers, send/recv: the total
        assert sum(gib[:6]) == pytest.approx(gib[6], abs=0.005)
        total += parameters
    holders = [s for s in range(P) if s == 0 or s == P - 1 or cut.stage_blocks(s)[1].start == 0
               and len(cut.stage_blocks(s)[1])]
    copies = (len(holders) - 1) * embedding + bias * (
        sum(len(cut.stage_blocks(s)[0]) > 0 for s in range(P)) - 1
        + sum(len(cut.stage_blocks(s)[1]) > 0 for s in range(P)) - 1)
    count = T5Model(T5Config(**PIPE_MODEL), device="meta")
    assert total == sum(p.numel() for p in count.parameters()) + copies
    if split == 2:  # encoder on stages 0-1: the embedding's copies on stages 0, 2 and 3
        assert holders == [0, 2, 3] and "split-rank 2" in out


def test_dry_run_without_pipeline_prints_no_stages(train_data, capsys):
    assert main(base_argv(train_data, "--dry-run")) == 0
    out = capsys.readouterr().out
    assert "pipeline" not in out and "send/recv" not in out and "total on device" in out
