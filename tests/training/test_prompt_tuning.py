"""Prompt tuning in real runs (megatron/training/prompt_tuning.py): a base model trained and
saved, then a prompt trained on it with every model parameter frozen: the model stays bit for
bit, the prompt moves, the loss falls (seq2seq pairs), the saved checkpoint holds the prompt
alone with its base's identity, a prompt is refused on another base, and TP 2 gives TP 1's
losses; --dry-run's memory against fine-tuning."""

import json

import pytest
import torch

from harness import run_workers
from train_workers import (base_argv, losses, run_keeping_model, run_pretrain,
                           run_pretrain_until_error)

from megatron.arguments import ArgumentsError, parse_args
from megatron.checkpoint.formats.deepspeed_files import load_file
from megatron.cost.memory import estimate_run
from megatron.model import T5Model
from megatron.pretrain_t5 import main

PROMPT = ["--prompt-tune", "--prompt-length", "6", "--prompt-positions", "0.5,0,0.5"]


def _module_file(folder):
    (tag,) = [p for p in folder.iterdir() if p.name.startswith("iter_")]
    return tag, load_file(tag / "mp_rank_00_model_states.pt")["module"]


@pytest.mark.slow
def test_prompt_tuning_freezes_the_model_and_saves_the_prompt(train_data, tmp_path):
    base, other, prompt = (str(tmp_path / n) for n in ("base", "other", "prompt"))
    run = lambda *extra, iters=8: base_argv(train_data, "--zero-stage", "1", *extra,  # noqa
                                            iters=iters)
    results = run_workers(1, run_keeping_model, [
        run("--save", base),
        run("--load", base, "--finetune", "--save", prompt, *PROMPT, "--lr", "0.05",
            "--prompt-init-token", "<extra_id_0>", "--eval-interval", "2", iters=10),
        # one step at lr 0: the prompt as it started
        run("--load", base, "--finetune", *PROMPT, "--lr", "0",
            "--prompt-init-token", "<extra_id_0>", iters=1),
    ], timeout=600)[0]
    trained, tuned, started = results
    _, base_module = _module_file(tmp_path / "base")
    # every model parameter bitwise unchanged; the prompt alone was trainable
    assert tuned["trainable"] == ["prompt.weight"]
    assert set(tuned["state"]) == set(base_module) | {"prompt.weight"}
    for name, tensor in base_module.items():
        assert torch.equal(tuned["state"][name], tensor), name
    # the prompt started at the token's embedding and moved
    from megatron.data.tokenizers.tokenizer import build_tokenizer, resolve_tokenizer
    token = build_tokenizer(resolve_tokenizer(train_data.spm)).vocab["<extra_id_0>"]
    start = base_module["shared.weight"][token]
    assert torch.equal(started["state"]["prompt.weight"], start.expand(6, -1))
    assert not torch.equal(tuned["state"]["prompt.weight"], start.expand(6, -1))
    # (the loss falling: test_prompt_tuning_on_seq2seq_pairs, a task with a clearer signal)
    # the saved checkpoint: the prompt alone, and the base it was trained on
    tag, saved = _module_file(tmp_path / "prompt")
    assert list(saved) == ["prompt.weight"]
    assert torch.equal(saved["prompt.weight"], tuned["state"]["prompt.weight"])
    meta = json.loads((tag / "meta.json").read_text())
    assert meta["model"]["prompt_base"]["load"] == base
    assert meta["model"]["prompt_base"]["iteration"] == 8
    size = sum(f.stat().st_size for f in tag.iterdir() if f.suffix == ".pt")
    base_size = sum(f.stat().st_size for f in next((tmp_path / "base").glob("iter_*")).iterdir()
                    if f.suffix == ".pt")
    assert size < base_size / 10, (size, base_size)
    # the prompt goes back onto its base, and is refused on another one, naming both
    # a prompt alone cannot be --load-ed as a model: the refusal says what to give instead
    with pytest.raises(ArgumentsError, match=f"--load {base} --finetune --prompt-tune "
                                             f"--prompt-load {prompt}"):
        parse_args(run("--load", prompt, *PROMPT), env={})
    # ... as the start of CPM-2-Finetune's second stage: the model trains too (lr 0 here, so
    # the prompt and the model are still the saved ones after the steps)
    (second,) = run_workers(1, run_keeping_model, [
        run("--load", base, "--finetune", *PROMPT, "--prompt-load", prompt,
            "--prompt-train-model", "--lr", "0", iters=2),
    ], timeout=600)[0]
    assert set(second["trainable"]) == set(base_module) | {"prompt.weight"}
    assert torch.equal(second["state"]["prompt.weight"], saved["prompt.weight"])
    assert all(torch.equal(second["state"][n], t) for n, t in base_module.items())
    run_workers(1, run_pretrain, [run("--seed", "8", "--save", other, iters=2)], timeout=600)
    refused = run_workers(1, run_pretrain_until_error, [
        run("--load", other, "--finetune", *PROMPT, "--prompt-load", prompt, iters=2),
    ], timeout=600)[0][0]
    assert "error" in refused
    assert f"{base} iteration 8" in refused["error"] and f"{other} iteration 2" in \
        refused["error"], refused["error"]


@pytest.mark.slow
def test_tensor_parallel_prompt_tuning_equals_one_rank(train_data):
    """TP 2 and TP 1 (both with 2 ranks: DP 1 and DP 2) give the same losses and prompts."""
    run = lambda *extra: base_argv(train_data, "--zero-stage", "1", *PROMPT,  # noqa: E731
                                   "--lr", "0.05", *extra)
    ranks = run_workers(2, run_keeping_model, [run("--tensor-model-parallel-size", "2"), run()],
                        timeout=600)
    tp2, tp1 = ranks[0]
    assert losses(tp2) == pytest.approx(losses(tp1), rel=1e-5)
    torch.testing.assert_close(tp2["state"]["prompt.weight"], tp1["state"]["prompt.weight"],
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ranks[1][0]["state"]["prompt.weight"],
                               tp2["state"]["prompt.weight"], rtol=0, atol=0)


def test_dry_run_counts_the_prompt_states_only(train_data, capsys):
    """--dry-run with --prompt-tune: the frozen model's parameters are held, its gradients and
    optimizer states are not; the prompt's are (bf16, ZeRO 2 over 4 ranks, on CUDA)."""
    argv = base_argv(train_data, "--dry-run", "--dry-run-device", "cuda", "--zero-stage", "2",
                     "--bf16", "--global-batch-size", "8")
    env = {"WORLD_SIZE": "4"}
    full = parse_args(argv, env=env)
    tuned = parse_args(argv + PROMPT, env=env)
    layout = full.layout()
    d_model = full.model.t5.d_model
    psi = sum(p.numel() for p in T5Model(full.model.t5, device="meta").parameters())
    want = estimate_run(layout, "cuda")
    got = estimate_run(tuned.layout(), "cuda", prompt_length=6, frozen_model=True)
    assert got.parameters == 2 * (psi + 6 * d_model)
    assert got.gradients == 2 * -(-6 * d_model // 4)  # the prompt's, partitioned
    assert got.optimizer_states == 12 * -(-6 * d_model // 4)
    assert want.optimizer_states == 12 * -(-psi // 4) and want.gradients == 2 * -(-psi // 4)
    assert got.total < want.total
    assert main(argv + PROMPT) == 0
    out = capsys.readouterr().out
    assert "prompt tuning: 6 vectors" in out and "frozen" in out


@pytest.mark.parametrize("extra,message", [
    (["--prompt-length", "4"], "--prompt-length has effect only with --prompt-tune"),
    # given as its default: still no effect without --prompt-tune (the flag was given)
    (["--prompt-length", "100"], "--prompt-length has effect only with --prompt-tune"),
    (PROMPT[:1] + ["--prompt-positions", "0.5,0.2"], "add up to 1"),
    (PROMPT[:1] + ["--prompt-positions", "front"], "comma-separated numbers"),
    (PROMPT + ["--zero-stage", "3"], "ZeRO stage 3"),
    (PROMPT + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "2"],
     "--prompt-tune needs --pipeline-model-parallel-size 1"),
])
def test_prompt_flags_are_checked(train_data, extra, message):
    with pytest.raises(ArgumentsError, match=message):
        parse_args(base_argv(train_data, *extra), env={"WORLD_SIZE": "2"})


@pytest.mark.slow
def test_prompt_tuning_on_seq2seq_pairs(train_data, tmp_path):
    """The cloze pairs of tests/data/finetune (megatron/data/datasets/seq2seq.py) on a base
    pretrained on the tests' corpus: the prompt alone lowers the validation loss."""
    from pathlib import Path

    finetune = Path(__file__).resolve().parents[1] / "data" / "finetune"
    base = str(tmp_path / "base")
    pairs = ["--finetune-data", str(finetune / "cloze_train.jsonl"), "--finetune-valid-data",
             str(finetune / "cloze_valid.jsonl"), "--tokenizer-model", train_data.spm,
             "--model-config", train_data.tiny, "--encoder-seq-length", "32",
             "--decoder-seq-length", "8", "--eval-interval", "4", "--eval-iters", "2",
             "--log-interval", "4", "--num-workers", "0", "--seed", "7",
             "--micro-batch-size", "2", "--global-batch-size", "4", "--zero-stage", "1"]
    _, tuned = run_workers(1, run_keeping_model, [
        base_argv(train_data, "--save", base, iters=8),
        pairs + ["--load", base, "--finetune", *PROMPT, "--lr", "0.1", "--lr-warmup-iters",
                 "1", "--train-iters", "16"],
    ], timeout=600)[0]
    valid = [e[2] for e in tuned["evals"] if e[1] == "valid"]  # the same batches each time
    assert len(valid) == 4 and valid == sorted(valid, reverse=True), valid
    assert valid[-1] < valid[0] - 0.05, valid
    assert tuned["trainable"] == ["prompt.weight"]


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["0", "2"])
def test_other_zero_stages_save_the_prompt_alone(train_data, tmp_path, stage):
    """ZeRO 0 (torch's AdamW) and 2 (gradients partitioned), 2 data-parallel ranks: the model
    from scratch stays as built, the prompt moves, the checkpoint holds the prompt alone."""
    save = tmp_path / "prompt"
    run = lambda *extra: base_argv(train_data, "--zero-stage", stage, *PROMPT,  # noqa: E731
                                   "--prompt-init-token", "random", *extra)
    ranks = run_workers(2, run_keeping_model, [run("--lr", "0"), run("--save", str(save))],
                        timeout=600)
    still, tuned = ranks[0]
    for name, tensor in still["state"].items():
        assert torch.equal(tuned["state"][name], tensor) != (name == "prompt.weight"), name
    assert torch.equal(ranks[1][1]["state"]["prompt.weight"], tuned["state"]["prompt.weight"])
    _, saved = _module_file(save)
    assert list(saved) == ["prompt.weight"]
