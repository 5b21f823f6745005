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
    from megatron.checkpoint.formats.deepspeed_files import load_file  # weights_only, allow-listed

    state = load_file(ckpt / "iter_0000002" / "mp_rank_00_model_states.pt")["module"]
    return {k: (v[:vocab_size] if k in ("shared.weight", "lm_head.weight") else v)
            for k, v in sorted(state.items())}


def test_a_weights_checkpoint_loads_in_every_layout(train_data, trained, tmp_path):
    from megatron.checkpoint.formats.weights import write_weights_checkpoint
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


def test_ours_to_hf_to_ours_with_the_command_line(train_data, trained, tmp_path):
    """convert_checkpoint.py: ours -> hf (weights, config, tokenizer) -> a weights checkpoint ->
    the trainer in TP=2 and PP=2 gives the original run's evaluations; ours -> fp32 is the
    checkpoint's weights bit for bit; --inspect describes it."""
    import json
    import subprocess
    import sys

    import safetensors.torch
    from transformers import AutoTokenizer, T5ForConditionalGeneration

    from data_tools import convert_checkpoint
    from megatron.data.tokenizers.tokenizer import T5Tokenizer
    from megatron.model.config import T5Config

    ckpt, reference = trained
    config = T5Config.from_json(train_data.tiny)
    hf, ours, fp32 = tmp_path / "hf", tmp_path / "ours", tmp_path / "fp32"
    assert convert_checkpoint.main(["--load", str(ckpt), "--to", "hf", str(hf),
                                    "--no-progress"]) == 0
    model = T5ForConditionalGeneration.from_pretrained(hf)
    assert model.config.vocab_size == config.vocab_size
    text = "Shall I compare thee 對酒當歌 🍵"  # the tokenizer came from the run's flags
    assert AutoTokenizer.from_pretrained(hf)(text)["input_ids"] == \
        T5Tokenizer(train_data.spm).encode(text) + [1]
    assert convert_checkpoint.main(["--from", "hf", str(hf), "--to", "megatron", str(ours),
                                    "--target-tensor-parallel-size", "2", "--no-progress"]) == 0
    assert convert_checkpoint.main(["--load", str(ckpt), "--to", "fp32", str(fp32),
                                    "--no-progress"]) == 0
    files = sorted((fp32 / "iter_0000002").glob("*.safetensors"))
    got = {}
    for f in files:
        got.update(safetensors.torch.load_file(f))
    want = module_weights(ckpt, config.vocab_size)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    inspect = subprocess.run([sys.executable, "data_tools/convert_checkpoint.py", "--inspect",
                              str(ckpt)], capture_output=True, text=True, check=True)
    assert json.loads(inspect.stdout)["iteration"] == 2

    run = lambda *extra: base_argv(train_data, "--load", str(ours), "--finetune",  # noqa: E731
                                   "--lr", "0", "--model-config",
                                   str(ours / "model_config.json"), *extra, iters=2)
    layouts = [["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"]]
    got_runs = run_workers(2, run_pretrain, [run(*layout) for layout in layouts],
                           timeout=900)[0]
    for layout, result in zip(layouts, got_runs):
        assert [e[2] for e in result["evals"]] == pytest.approx(
            [e[2] for e in reference["evals"]], rel=2e-5), layout
