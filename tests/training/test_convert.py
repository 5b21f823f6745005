"""Checkpoint conversion end to end (data_tools/convert_checkpoint.py, megatron/checkpoint/):
a weights checkpoint starts the trainer in any layout with the weights it holds."""

import pytest
import torch

from harness import run_workers
from train_workers import base_argv, run_pretrain

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trained(train_data, tmp_path_factory):
    """A 2-step one-process run saved (fp32, ZeRO-0) and, from its weights, the evaluations of
    a --finetune --lr 0 run (the reference every layout must reproduce)."""
    ckpt = tmp_path_factory.mktemp("trained") / "ckpt"
    first, again = run_workers(1, run_pretrain, [
        base_argv(train_data, "--save", str(ckpt), iters=2),
        base_argv(train_data, "--load", str(ckpt), "--finetune", "--lr", "0", iters=2),
    ], timeout=600)[0]
    return ckpt, again


def module_weights(ckpt, vocab_size):
    """The one-process checkpoint's full weights (its module file), vocabulary unpadded."""
    state = torch.load(ckpt / "iter_0000002" / "mp_rank_00_model_states.pt",
                       weights_only=False)["module"]
    return {k: (v[:vocab_size] if k in ("shared.weight", "lm_head.weight") else v)
            for k, v in sorted(state.items())}


def test_a_weights_checkpoint_loads_in_every_layout(train_data, trained, tmp_path):
    from megatron.checkpoint.weights import write_weights_checkpoint
    from megatron.model.config import T5Config

    ckpt, reference = trained
    config = T5Config.from_json(train_data.tiny)
    out = tmp_path / "weights"
    write_weights_checkpoint(out, module_weights(ckpt, config.vocab_size).items(),
                             {"config": config.to_dict()}, max_shard_size="100KB")
    assert (out / "iter_0000000" / "model.safetensors.index.json").is_file()  # sharded
    run = lambda *extra: base_argv(train_data, "--load", str(out), "--finetune",  # noqa: E731
                                   "--lr", "0", *extra, iters=2)
    layouts = [["--tensor-model-parallel-size", "2", "--zero-stage", "1"],
               ["--pipeline-model-parallel-size", "2"],
               ["--zero-stage", "3", "--tensor-model-parallel-size", "2"],
               ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]]
    got = run_workers(4, run_pretrain, [run(*layout) for layout in layouts], timeout=900)[0]
    for layout, result in zip(layouts, got):
        assert [e[:2] for e in result["evals"]] == [e[:2] for e in reference["evals"]]
        assert [e[2] for e in result["evals"]] == pytest.approx(
            [e[2] for e in reference["evals"]], rel=2e-5), layout
