"""--log-grad-norms-per-layer: the squares of the per-layer norms sum to the square of the global
gradient norm the run logs (rel 1e-5) under TP=2, ZeRO-3 DP=2 and PP=2, and each layer's norm
is the one a single process gets (the same gradients, however they are sharded); the log line
and the TensorBoard scalars follow the format the plot command reads."""

import math
import re

import pytest

from harness import run_workers
from megatron.training.layer_norms import format_layer_norms, group_of, layer_groups
from train_workers import base_argv, run_pretrain

TINY_GROUPS = ["embedding", "encoder.block.0", "encoder.block.1", "encoder.final_layer_norm",
               "decoder.block.0", "decoder.block.1", "decoder.final_layer_norm", "lm_head"]


def test_groups_cover_the_t5_names():
    """Every single-process parameter name falls in one group, in log order."""
    import torch

    from megatron.model.config import T5Config
    from megatron.model.t5 import T5Model

    assert layer_groups(2, 2, tied_head=False) == TINY_GROUPS
    assert layer_groups(2, 2, tied_head=True) == TINY_GROUPS[:-1]
    config = T5Config(vocab_size=64, d_model=8, d_kv=4, d_ff=16, num_layers=2,
                      num_decoder_layers=2, num_heads=2, tie_word_embeddings=False)
    with torch.device("meta"):
        names = [n for n, _ in T5Model(config).named_parameters()]
    groups = {n: group_of(n) for n in names}
    assert set(groups.values()) == set(TINY_GROUPS)
    assert groups["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"] \
        == "encoder.block.0"
    assert groups["decoder.block.1.layer.2.layer_norm.weight"] == "decoder.block.1"
    assert group_of("encoder.block.10.layer.0.SelfAttention.q.weight") == "encoder.block.10"
    assert group_of("pooler.weight") is None


def test_log_line_format():
    line = format_layer_norms(120, {"embedding": 0.1234, "encoder.block.0": 5.678e-2,
                                    "lm_head": 0.2})
    assert line == (" grad norm per layer at iteration 120: embedding 1.234E-01, "
                    "encoder.block.0 5.678E-02, lm_head 2.000E-01")


@pytest.fixture(scope="module")
def single(train_data, tmp_path_factory):
    """One process, accumulation 2, with the log file and TensorBoard."""
    out = tmp_path_factory.mktemp("layer_norms")
    argv = base_argv(train_data, "--log-grad-norms-per-layer", "--log-file",
                     str(out / "log.txt"), "--tensorboard-dir", str(out / "tb"))
    return run_workers(1, run_pretrain, [argv], timeout=600)[0][0], out


def assert_squares_sum_to_global(result):
    norms, layers = result["grad_norms"], result["layer_grad_norms"]
    assert sorted(layers) == [2, 4]  # the logged iterations
    for iteration, by_group in layers.items():
        assert list(by_group) == TINY_GROUPS
        assert all(v > 0 for v in by_group.values())
        total = sum(v * v for v in by_group.values())
        assert total == pytest.approx(norms[iteration] ** 2, rel=1e-5), iteration


@pytest.mark.slow
def test_single_process_log_line_and_tensorboard(single):
    result, out = single
    assert_squares_sum_to_global(result)
    lines = [line for line in (out / "log.txt").read_text().splitlines()
             if "grad norm per layer" in line]
    assert len(lines) == 2
    for line, iteration in zip(lines, (2, 4)):
        match = re.fullmatch(r" grad norm per layer at iteration (\d+): (.*)", line)
        assert match and int(match.group(1)) == iteration
        pairs = [p.split(" ") for p in match.group(2).split(", ")]
        assert [g for g, _ in pairs] == TINY_GROUPS
        want = result["layer_grad_norms"][iteration]
        assert [float(v) for _, v in pairs] == pytest.approx(list(want.values()), rel=1e-3)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tb"))
    acc.Reload()
    for group in TINY_GROUPS:
        events = acc.Scalars(f"grad-norm-per-layer/{group}")
        assert [e.step for e in events] == [2, 4]
        want = [result["layer_grad_norms"][i][group] for i in (2, 4)]
        assert [e.value for e in events] == pytest.approx(want, rel=1e-6)


@pytest.mark.slow
def test_sharded_runs_match_the_global_norm_and_one_process(train_data, single):
    """TP=2 (ZeRO-0), DP=2 under ZeRO-0, 3 and 1, PP=2 (ZeRO-0 and ZeRO-1): the squares sum to the
    run's own global norm, and each group's norm is the single process's (shards counted once,
    replicas not twice)."""
    runs = [("--tensor-model-parallel-size", "2"), (), ("--zero-stage", "3"),
            ("--zero-stage", "1"), ("--pipeline-model-parallel-size", "2"),
            ("--pipeline-model-parallel-size", "2", "--zero-stage", "1")]
    got = run_workers(2, run_pretrain,
                      [base_argv(train_data, "--log-grad-norms-per-layer", *r) for r in runs],
                      timeout=1200)
    reference = single[0]["layer_grad_norms"]
    for flags, result, other in zip(runs, got[0], got[1]):
        assert other["layer_grad_norms"] == result["layer_grad_norms"], flags  # all ranks agree
        assert_squares_sum_to_global(result)
        for iteration, by_group in result["layer_grad_norms"].items():
            for group, value in by_group.items():
                assert math.isclose(value, reference[iteration][group], rel_tol=1e-4), \
                    (flags, iteration, group, value, reference[iteration][group])


@pytest.mark.slow
def test_bf16_and_offloaded_runs_match_their_global_norm(train_data):
    """The other places DeepSpeed keeps gradients: bf16 under ZeRO-1 and 3, DeepSpeed's bf16
    optimizer under a pipeline (full fp32 buffers, fragments owned per rank), ZeRO-2 and 3 with
    the optimizer (and parameters) offloaded to the CPU."""
    runs = [("--bf16", "--zero-stage", "1"), ("--bf16", "--zero-stage", "3"),
            ("--pipeline-model-parallel-size", "2", "--bf16", "--zero-stage", "1"),
            ("--zero-stage", "2", "--offload-optimizer", "cpu"),
            ("--zero-stage", "3", "--offload-optimizer", "cpu", "--offload-param", "cpu")]
    got = run_workers(2, run_pretrain,
                      [base_argv(train_data, "--log-grad-norms-per-layer", *r) for r in runs],
                      timeout=1200)
    for flags, result, other in zip(runs, got[0], got[1]):
        assert other["layer_grad_norms"] == result["layer_grad_norms"], flags
        assert_squares_sum_to_global(result)
