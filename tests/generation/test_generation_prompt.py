"""`python -m megatron.generate` with a tuned prompt (megatron/generation/prompt.py): a prompt
on its base (--prompt-load) and a second stage's checkpoint (model and prompt) decode the greedy
ids of the model's own forward with the prompt attached; a prompt on another base, or a prompt
alone as --load, is refused naming both; a prompt trained at TP 2 decodes on its base at TP 1
and TP 2 (the base's identity is its checkpoint's full tensors, whatever the layout)."""

import json

import pytest
import torch
from harness import run_workers
from train_workers import base_argv, run_pretrain

from megatron import generate
from megatron.checkpoint.formats.deepspeed import (find_iteration, iter_full_tensors,
                                                   model_config, read_meta)
from megatron.data.tokenizers.tokenizer import build_tokenizer, resolve_tokenizer
from megatron.model import T5Model
from megatron.model.prompt import PROMPT_PARAMETER, PromptLayout, attach_prompt
from megatron.model.state_dict import load_full_state_dict

pytestmark = pytest.mark.slow

PROMPT = ["--prompt-tune", "--prompt-length", "4", "--prompt-positions", "0.5,0.5",
          "--prompt-init-token", "random"]
TEXTS = ["To be, or not to be", "Good morrow, kind sir, and well met.", "The king"]


@pytest.fixture(scope="module")
def tuned(train_data, tmp_path_factory):
    """Folders: base, other (another base), prompt (tuned on base), stage2 (model and prompt,
    from base and prompt); base_tp2 and prompt_tp2 (the same at TP 2). Each fine-tuning run
    takes 2 steps: the first one's learning rate is 0 (warmup from 0, --lr-warmup-iters 1),
    so a 1-step run would save what it loaded."""
    root = tmp_path_factory.mktemp("prompted")
    f = {n: str(root / n) for n in ("base", "other", "prompt", "stage2", "base_tp2",
                                    "prompt_tp2")}
    run = lambda *extra, iters=2: base_argv(train_data, "--zero-stage", "1", *extra,  # noqa
                                            iters=iters)
    run_workers(1, run_pretrain, [
        run("--save", f["base"]), run("--seed", "8", "--save", f["other"]),
        run("--load", f["base"], "--finetune", "--save", f["prompt"], *PROMPT, "--lr", "0.05"),
        run("--load", f["base"], "--finetune", "--save", f["stage2"], *PROMPT, "--prompt-load",
            f["prompt"], "--prompt-train-model", "--lr", "3e-3"),
    ], timeout=600)
    tp2 = ("--tensor-model-parallel-size", "2")
    run_workers(2, run_pretrain, [
        run("--save", f["base_tp2"], *tp2),
        run("--load", f["base_tp2"], "--finetune", "--save", f["prompt_tp2"], *tp2, *PROMPT,
            "--lr", "0.05"),
    ], timeout=600)
    return f


def _generate(train_data, tmp_path, capsys, *extra):
    """(exit code, each output's ids, stderr) of megatron.generate's greedy search here."""
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS), encoding="utf-8")
    out = tmp_path / "out.jsonl"
    out.unlink(missing_ok=True)
    capsys.readouterr()
    code = generate.main(["--tokenizer-model", train_data.spm, "--input", str(inp),
                          "--output", str(out), "--max-new-tokens", "6",
                          "--micro-batch-size", "2", *extra])
    ids = [json.loads(line)["ids"] for line in out.read_text().splitlines()] if code == 0 \
        else None
    return code, ids, capsys.readouterr().err


def _saved_prompt(folder):
    """The prompt a prompt-tuning run saved in `folder` (its latest checkpoint's file)."""
    from megatron.checkpoint.formats.deepspeed_files import load_file

    return load_file(find_iteration(folder) / "mp_rank_00_model_states.pt")["module"][
        PROMPT_PARAMETER]


def _reference(train_data, folder, prompt_folder=None, steps=6):
    """Greedy ids of the model's own forward (no cache, one input at a time, no padding), the
    prompt of `prompt_folder` attached (default: the one saved with the model, if any)."""
    folder = find_iteration(folder)
    meta = read_meta(folder)
    config = model_config(meta, folder / "meta.json")
    model = T5Model(config, make_vocab_size_divisible_by=meta["model"][
        "make_vocab_size_divisible_by"])
    full = dict(iter_full_tensors(folder))
    prompt = full.pop(PROMPT_PARAMETER, None)
    load_full_state_dict(model, full)
    source = meta if prompt_folder is None else read_meta(find_iteration(prompt_folder))
    if prompt_folder is not None:
        prompt = _saved_prompt(prompt_folder)
    saved = source["model"]["prompt_layout"]
    assert saved == {"length": 4, "ratios": [0.5, 0.5]}  # recorded at save
    attach_prompt(model, PromptLayout(saved["length"], tuple(saved["ratios"])))
    with torch.no_grad():
        model.prompt.weight.copy_(prompt)
    model.eval()
    tok = build_tokenizer(resolve_tokenizer(train_data.spm))
    out = []
    for text in TEXTS:
        ids = torch.tensor([tok.encode(text, add_eos=True)])
        decoded = [tok.decoder_start_token_id]
        with torch.no_grad():
            for _ in range(steps):
                logits = model(ids, torch.tensor([decoded]), torch.ones_like(ids)).logits
                decoded.append(int(logits[0, -1, :config.vocab_size].argmax()))
                if decoded[-1] == tok.eos_id:
                    break
        out.append(decoded[1:])
    return out, model


def test_generate_with_a_prompt(train_data, tuned, tmp_path, capsys):
    code, got, err = _generate(train_data, tmp_path, capsys, "--load", tuned["base"],
                               "--prompt-load", tuned["prompt"])
    assert code == 0, err
    want, _ = _reference(train_data, tuned["base"], tuned["prompt"])
    assert got == want
    code, plain, err = _generate(train_data, tmp_path, capsys, "--load", tuned["base"])
    assert code == 0 and plain != got, err  # the prompt changes what is decoded


def test_a_second_stage_checkpoint_decodes_with_its_prompt(train_data, tuned, tmp_path,
                                                           capsys):
    code, got, err = _generate(train_data, tmp_path, capsys, "--load", tuned["stage2"])
    assert code == 0, err
    want, _ = _reference(train_data, tuned["stage2"])
    assert got == want
    # the prompt in the checkpoint (the reference's) is stage 2's (it was trained too), not
    # the first stage's
    own = dict(iter_full_tensors(find_iteration(tuned["stage2"])))[PROMPT_PARAMETER]
    assert own.shape == _saved_prompt(tuned["prompt"]).shape
    assert not torch.equal(own, _saved_prompt(tuned["prompt"]))
    code, _, err = _generate(train_data, tmp_path, capsys, "--load", tuned["stage2"],
                             "--prompt-load", tuned["prompt"])
    assert code == 2 and "holds a prompt of its own" in err


def test_a_prompt_on_another_base_is_refused(train_data, tuned, tmp_path, capsys):
    code, _, err = _generate(train_data, tmp_path, capsys, "--load", tuned["other"],
                             "--prompt-load", tuned["prompt"])
    assert code == 2
    assert f"--prompt-load {tuned['prompt']}" in err
    assert f"{tuned['base']} iteration 2" in err and f"{tuned['other']} iteration 2" in err
    code, _, err = _generate(train_data, tmp_path, capsys, "--load", tuned["prompt"])
    assert code == 2
    assert f"--load {tuned['base']} --prompt-load {tuned['prompt']}" in err


def test_a_prompt_trained_at_tp2_decodes_on_its_base_at_tp1_and_2(train_data, tuned,
                                                                  tmp_path, capsys):
    code, got, err = _generate(train_data, tmp_path, capsys, "--load", tuned["base_tp2"],
                               "--prompt-load", tuned["prompt_tp2"])
    assert code == 0, err
    want, _ = _reference(train_data, tuned["base_tp2"], tuned["prompt_tp2"])
    assert got == want
    # and decoded at TP 2 (the prompt copied on both tensor ranks): the same ids
    from generation_workers import run_generate

    out = tmp_path / "out_tp2.jsonl"
    argv = ["--load", tuned["base_tp2"], "--prompt-load", tuned["prompt_tp2"],
            "--tokenizer-model", train_data.spm, "--input", str(tmp_path / "in.jsonl"),
            "--output", str(out), "--max-new-tokens", "6", "--micro-batch-size", "2"]
    result = run_workers(2, run_generate, argv, timeout=300)[0]
    assert result["code"] == 0
    assert [json.loads(line)["ids"] for line in result["text"].splitlines()] == want


def test_a_prompt_decodes_in_a_pipeline(train_data, tuned, tmp_path, capsys):
    """PP 2 (the prompt on stage 0, the grown encoder mask sent on): --prompt-load's prompt
    and a second stage's own decode as the model's own forward does."""
    from generation_workers import run_generate

    _generate(train_data, tmp_path, capsys, "--load", tuned["base"])  # writes in.jsonl
    for load in (["--load", tuned["base"], "--prompt-load", tuned["prompt"]],
                 ["--load", tuned["stage2"]]):
        out = tmp_path / "out_pp2.jsonl"
        argv = [*load, "--tokenizer-model", train_data.spm, "--input", str(tmp_path / "in.jsonl"),
                "--output", str(out), "--max-new-tokens", "6", "--micro-batch-size", "2",
                "--pipeline-model-parallel-size", "2"]
        result = run_workers(2, run_generate, argv, timeout=300)[0]
        assert result["code"] == 0, result
        want, _ = _reference(train_data, load[1], load[3] if len(load) > 2 else None)
        assert [json.loads(line)["ids"] for line in result["text"].splitlines()] == want


def test_evaluate_with_a_prompt_scores_the_models_own_forward(train_data, tuned):
    """megatron.evaluate's model with --prompt-load (load_lm) answers the harness's
    loglikelihood requests as the model's own forward with the prompt attached does, one
    request at a time without padding: the continuation's summed log-softmax behind the
    decoder start token, the context with EOS."""
    from lm_eval.api.instance import Instance

    from megatron.evaluate import load_lm

    pairs = [("To be, or not to be", " that is"), ("Good morrow, kind sir", ", and well met."),
             ("The king", " is dead")]
    lm = load_lm(tuned["base"], train_data.spm, prompt_load=tuned["prompt"], batch_size=2)
    got = lm.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)])
    _, model = _reference(train_data, tuned["base"], tuned["prompt"])
    tok = build_tokenizer(resolve_tokenizer(train_data.spm))
    for (context, continuation), (logprob, _) in zip(pairs, got):
        ids = torch.tensor([tok.encode(context, add_eos=True)])
        target = tok.encode(continuation)
        decoder = torch.tensor([[tok.decoder_start_token_id] + target[:-1]])
        with torch.no_grad():
            logits = model(ids, decoder, torch.ones_like(ids)).logits[0, :, :model.config.vocab_size]
        want = logits.float().log_softmax(-1).gather(1, torch.tensor(target)[:, None]).sum()
        assert logprob == pytest.approx(float(want), rel=1e-5, abs=1e-4)
    plain = load_lm(tuned["base"], train_data.spm).loglikelihood(
        [Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)])
    assert [a[0] for a in plain] != pytest.approx([a[0] for a in got])  # the prompt counts
