"""A prompt-tuning job requeued with its command line resumes exactly: --load BASE --finetune
loads the base's weights, then --save's checkpoint resumes the prompt (or, in the second stage,
the model and the prompt), their Adam states, the iteration, the samples, the LR schedule and
the random states. 2N steps straight give the losses and the prompt of N steps + a restart of
the same command line for N more; a --save trained on another base is refused, naming both."""

import pytest
import torch

from harness import run_workers
from train_workers import (base_argv, built_steps, losses, run_pretrain,
                           run_pretrain_until_error)

from megatron.arguments import ArgumentsError, parse_args
from megatron.checkpoint.formats.deepspeed import find_iteration, read_meta

pytestmark = pytest.mark.slow

PROMPT = ["--prompt-tune", "--prompt-length", "4", "--prompt-positions", "0.5,0.5",
          "--prompt-init-token", "<extra_id_0>"]


def run_keeping_prompt(rank, world_size, argvs):
    """As run_pretrain_until_error; each result also holds the prompt after the run and the
    log's lines."""
    with built_steps() as built:
        out = []
        for argv in argvs:
            result = run_pretrain_until_error(rank, world_size, [argv])[0]
            prompt = built[-1].engine.module.prompt if "error" not in result else None
            if prompt is not None:
                result["prompt"] = prompt.weight.detach().clone()
            out.append(result)
        return out


def _log(tmp_path, name):
    return (tmp_path / f"{name}.log").read_text()


def test_requeued_prompt_tuning_resumes_exactly(train_data, tmp_path):
    base, other = str(tmp_path / "base"), str(tmp_path / "other")
    straight, requeued, second, again = (str(tmp_path / n) for n in ("straight", "requeued",
                                                                      "second", "again"))
    run = lambda *extra, iters=4: base_argv(train_data, "--zero-stage", "1", *extra,  # noqa
                                            model=train_data.tiny_dropout, iters=iters)
    # the same command line twice: the first stops at 2 (and saves), the second resumes
    tune = lambda save, *extra: run("--load", base, "--finetune", "--save", save, *PROMPT,  # noqa
                                    "--lr", "0.05", "--exit-interval", "2", *extra)
    stage2 = lambda save: tune(save, "--prompt-load", straight,  # noqa: E731
                               "--prompt-train-model", "--lr", "1e-3")
    results = run_workers(1, run_keeping_prompt, [
        run("--save", base, iters=2),
        run("--load", base, "--finetune", "--save", straight, *PROMPT, "--lr", "0.05",
            "--log-file", str(tmp_path / "straight.log")),
        tune(requeued), tune(requeued, "--log-file", str(tmp_path / "requeued.log")),
        run("--seed", "8", "--save", other, iters=2),
        run("--load", other, "--finetune", "--save", requeued, *PROMPT, "--lr", "0.05",
            "--exit-interval", "2"),
        # the second stage (model and prompt), straight and requeued
        run("--load", base, "--finetune", *PROMPT, "--prompt-load", straight,
            "--prompt-train-model", "--lr", "1e-3"),
        stage2(second), stage2(second),
        # ... and as a normal resume: --load of its own --save, without --finetune
        stage2(again), run("--load", again, "--save", again, *PROMPT, "--prompt-train-model",
                           "--lr", "1e-3"),
    ], timeout=600)[0]
    _, whole, first, resumed, _, refused, whole2, first2, resumed2, _, loaded2 = results
    assert sorted(first["losses"]) == [1, 2] and sorted(resumed["losses"]) == [3, 4]
    # one process on CPU in fp32 is deterministic: a resume that is exact gives the same bits
    # (a tolerance would pass a resume whose Adam states or random states were off slightly)
    assert losses(first) + losses(resumed) == losses(whole)
    evals = lambda r: [e[2] for e in r["evals"]]  # noqa: E731
    assert evals(first) + evals(resumed) == evals(whole)
    assert torch.equal(resumed["prompt"], whole["prompt"])
    # the base loaded first, then the resume (not "optimizer ... start fresh" before it)
    requeued_log = _log(tmp_path, "requeued")
    assert f"loaded the base weights of {base} iteration 2 (--finetune); the prompt-tuning " \
           f"run resumes from --save {requeued}" in requeued_log
    assert "start fresh" not in requeued_log
    assert f"resumed from {requeued} at iteration 2" in requeued_log
    assert "resumed from" not in _log(tmp_path, "straight")
    # a --save whose prompt was trained on another base: refused, naming both
    assert "error" in refused and f"{base} iteration 2" in refused["error"] \
        and f"{other} iteration 2" in refused["error"], refused
    assert f"--save {requeued}" in refused["error"]
    # the second stage resumes the model and the prompt the same way
    assert sorted(first2["losses"]) == [1, 2] and sorted(resumed2["losses"]) == [3, 4]
    assert losses(first2) + losses(resumed2) == losses(whole2)
    assert torch.equal(resumed2["prompt"], whole2["prompt"])
    assert losses(loaded2) == losses(resumed2)
    assert torch.equal(loaded2["prompt"], whole2["prompt"])
    # its checkpoints still name the base it was trained on, not themselves
    metas = [read_meta(find_iteration(folder)) for folder in (second, again)]
    assert metas[0]["model"]["prompt_base"] == metas[1]["model"]["prompt_base"]
    assert metas[1]["model"]["prompt_base"]["load"] == base


@pytest.mark.parametrize("stage", ["0", "2"])
def test_requeued_prompt_tuning_resumes_exactly_on_two_ranks(train_data, tmp_path, stage):
    """ZeRO 0 (torch's AdamW states in the model file) and 2 (the prompt's states partitioned
    over 2 data-parallel ranks); the base saved at the same stage (a ZeRO-2 base's empty
    frozen_param_fragments: deepspeed_internals.frozen_weights_from_module)."""
    base, straight, requeued = (str(tmp_path / n) for n in ("base", "straight", "requeued"))
    run = lambda *extra, iters=4: base_argv(train_data, "--zero-stage", stage, *extra,  # noqa
                                            model=train_data.tiny_dropout, iters=iters)
    tune = lambda save, *extra: run("--load", base, "--finetune", "--save", save, *PROMPT,  # noqa
                                    "--lr", "0.05", *extra)
    ranks = run_workers(2, run_keeping_prompt, [
        run("--save", base, iters=1), tune(straight),
        tune(requeued, "--exit-interval", "2"), tune(requeued, "--exit-interval", "2"),
    ], timeout=600)
    _, whole, first, resumed = ranks[0]
    assert sorted(first["losses"]) == [1, 2] and sorted(resumed["losses"]) == [3, 4]
    assert losses(first) + losses(resumed) == losses(whole)  # deterministic CPU fp32: exact
    for rank in ranks:
        assert torch.equal(rank[3]["prompt"], whole["prompt"])


def test_a_save_that_cannot_resume_is_refused(train_data, tmp_path):
    """Before anything starts: a second stage's --save that holds the first stage's checkpoint
    (a prompt alone) would resume into the wrong optimizer; a --save saved at another layout or
    with another LR schedule is named as --save; a resume with another prompt length or other
    positions is refused naming the saved ones. A second stage without --prompt-length takes
    the length (and positions) of --prompt-load's prompt and trains."""
    base, prompt, stage2 = (str(tmp_path / n) for n in ("base", "prompt", "stage2"))
    run = lambda *extra: base_argv(train_data, "--zero-stage", "1", *extra, iters=1)  # noqa
    results = run_workers(1, run_pretrain, [
        run("--save", base), run("--load", base, "--finetune", "--save", prompt, *PROMPT),
        run("--load", base, "--finetune", "--prompt-tune", "--prompt-load", prompt,
            "--prompt-train-model", "--save", stage2),
    ], timeout=600)[0]
    assert "error" not in results[2] and sorted(results[2]["losses"]) == [1], results[2]
    saved = read_meta(find_iteration(stage2))["model"]["prompt_layout"]
    assert (saved["length"], saved["ratios"]) == (4, [0.5, 0.5])
    for flags, message in [
            (["--prompt-length", "8"], f"--prompt-length 8: --prompt-load {prompt} holds a "
                                       f"prompt tuned with --prompt-length 4"),
            (["--prompt-load", base], f"--prompt-load {base} holds no prompt-tuning")]:
        with pytest.raises(ArgumentsError, match=message):
            parse_args(run("--load", base, "--finetune", "--prompt-tune", "--prompt-load",
                           prompt, "--prompt-train-model", *flags), env={})
    resumed = f"the checkpoint this run resumes \\(--save {prompt}, requeued\\) was tuned with"
    for flags, message in [(["--prompt-length", "6"], "--prompt-length 6: " + resumed
                             + " --prompt-length 4"),
                           (["--prompt-positions", "1"], "--prompt-positions 1: " + resumed
                            + " --prompt-positions 0.5,0.5")]:
        with pytest.raises(ArgumentsError, match=message):
            parse_args(run("--load", base, "--finetune", "--save", prompt, *PROMPT, *flags),
                       env={})
    with pytest.raises(ArgumentsError, match=f"--prompt-length 5: the checkpoint this run "
                                             f"resumes \\(--load {stage2}\\)"):
        parse_args(run("--load", stage2, "--save", stage2, "--prompt-tune",
                       "--prompt-train-model", "--prompt-length", "5"), env={})
    with pytest.raises(ArgumentsError, match=f"--save {prompt} holds a checkpoint of a "
                                             f"prompt alone"):
        parse_args(run("--load", base, "--finetune", *PROMPT, "--prompt-load", prompt,
                       "--prompt-train-model", "--save", prompt), env={})
    tune = ["--load", base, "--finetune", "--save", prompt, *PROMPT]
    with pytest.raises(ArgumentsError, match=f"--save {prompt} \\(resumed\\): the checkpoint "
                                             f"was saved with another layout"):
        parse_args(run(*tune, "--zero-stage", "2"), env={"WORLD_SIZE": "1"})
    with pytest.raises(ArgumentsError, match=f"--save {prompt} \\(resumed\\)"):
        parse_args(run(*tune, "--lr", "0.5"), env={})
    parse_args(run(*tune), env={})  # the same command line resumes
