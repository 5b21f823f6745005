"""Seq2seq fine-tuning through the real entry point (docs/finetuning.md): the pairs of
tests/data/finetune train a tiny model, from scratch or from a pretraining run's checkpoint
(--load --finetune); TP 2 and ZeRO data parallelism give one process's losses; bad flags are
refused with one message each."""

import json
import re
from pathlib import Path

import pytest
import torch

from harness import run_workers
from megatron.data.tokenizers.tokenizer import build_tokenizer, resolve_tokenizer
from train_workers import (assert_same_run, base_argv, losses, reference_model,
                           run_keeping_model, run_pretrain, split_batches, whole_model_state)

FINETUNE = Path(__file__).resolve().parents[1] / "data" / "finetune"
TRAIN, VALID = str(FINETUNE / "cloze_train.jsonl"), str(FINETUNE / "cloze_valid.jsonl")


def finetune_argv(data, *extra, iters=4):
    """4 steps, global batch 4, 32 encoder and 8 decoder tokens, validation every 2 steps over
    5 batches: 20 samples of the 16 examples (each scored once)."""
    return ["--finetune-data", TRAIN, "--finetune-valid-data", VALID,
            "--tokenizer-model", data.spm, "--model-config", data.tiny, "--lr", "3e-3",
            "--lr-warmup-iters", "1", "--train-iters", str(iters),
            "--encoder-seq-length", "32", "--decoder-seq-length", "8",
            "--eval-interval", "2", "--eval-iters", "5", "--log-interval", "2",
            "--num-workers", "0", "--seed", "7", "--micro-batch-size", "2",
            "--global-batch-size", "4", *extra]


@pytest.fixture(scope="module")
def single_log(train_data, tmp_path_factory):
    """One process, gradient accumulation 2, label words (two of the cloze targets): the
    result and the log."""
    log = tmp_path_factory.mktemp("finetune") / "single.log"
    result = run_workers(1, run_keeping_model, [finetune_argv(
        train_data, *WORDS, "--log-file", str(log))], timeout=600)[0][0]
    return result, log.read_text()


WORDS = ["--label-words", "proceed", "resolved"]


def reference_greedy(model, batch, tokenizer, max_new_tokens):
    """Each row's greedy decoding as text, recomputed without megatron/generation: the whole
    decoder input run again for every new token (no cache), argmax over the real vocabulary."""
    ids, mask = batch["encoder_input_ids"], batch["encoder_attention_mask"]
    start, eos = tokenizer.decoder_start_token_id, tokenizer.eos_id
    out = torch.full((ids.shape[0], 1), start, dtype=torch.long)
    done = torch.zeros(ids.shape[0], dtype=torch.bool)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(ids, out, mask).logits[:, -1, :model.config.vocab_size]
            token = torch.where(done, torch.tensor(tokenizer.pad_id), logits.argmax(-1))
            out = torch.cat([out, token[:, None]], dim=1)
            done |= token == eos
    return [tokenizer.decode([i for i in row[1:] if i not in (eos, tokenizer.pad_id)])
            for row in out.tolist()]


@pytest.fixture(scope="module")
def single(single_log):
    return single_log[0]


def test_finetuning_learns_and_validates(single_log, train_data):
    single, log = single_log
    fp32 = losses(single)
    assert fp32[-1] < fp32[0]
    # validation at steps 2 and 4 (the last one also serves as the final); no test split
    assert [e[:2] for e in single["evals"]] == [(2, "valid"), (4, "valid")]
    # the teacher-forced accuracy of target tokens, named as such (no spans in seq2seq)
    assert re.search(r"validation loss at iteration 2 \| .* \| token accuracy: [0-9.]+ \|$",
                     log, re.M) and "span accuracy" not in log
    # with the loss, the greedy decoding's exact match and label accuracy over the 16
    # validation examples, each once (eval_iters 5 x global batch 4 = 20 samples: the last 4
    # repeat the first 4 and are not scored again), recomputed here from the final model
    lines = re.findall(r"validation generation at iteration (\d+) \| exact match: ([0-9.]+) "
                       r"\| label accuracy: ([0-9.]+) \| (\d+) examples \|", log)
    assert [(int(i), int(n)) for i, _, _, n in lines] == [(2, 16), (4, 16)]
    tokenizer = build_tokenizer(resolve_tokenizer(train_data.spm))
    argv = finetune_argv(train_data)
    model = reference_model(argv, single["state"])
    rows = [json.loads(line) for line in open(VALID, encoding="utf-8")]
    predictions = [p for batch in split_batches(argv, "valid", 4, 4)
                   for p in reference_greedy(model, batch, tokenizer, 8)]
    exact = sum(p.strip() == r["target"].strip() for p, r in zip(predictions, rows))
    labels = sum(p.strip() == r["target"] and p.strip() in ("proceed", "resolved")
                 for p, r in zip(predictions, rows))
    assert (float(lines[1][1]), float(lines[1][2])) == (round(exact / 16, 4),
                                                        round(labels / 16, 4)), predictions
    # and the final validation loss is the final model's, token-weighted over those 16
    loss_sum = tokens = 0.0
    with torch.no_grad():
        for batch in split_batches(argv, "valid", 4, 4):
            out = model(batch["encoder_input_ids"], batch["decoder_input_ids"],
                        batch["encoder_attention_mask"], batch["decoder_attention_mask"],
                        batch["labels"])
            loss_sum += float(out.token_losses.double().sum())
            tokens += int((batch["labels"] != -100).sum())
    assert single["evals"][1][2] == pytest.approx(loss_sum / tokens, rel=1e-6)


def own_targets(argv, state, spm, path):
    """Write to `path` the validation file with each target that the model of `state` decodes
    within the 8 decoder tokens (with EOS) replaced by that decoding (the recount's); returns
    the line of the final validation that file must give, with the first of those decodings as
    the label word (the flags that say so: `--label-words WORD`)."""
    tokenizer = build_tokenizer(resolve_tokenizer(spm))
    model = reference_model(argv, state)
    rows = [json.loads(line) for line in open(VALID, encoding="utf-8")]
    predictions = [p for batch in split_batches(argv, "valid", 4, 4)
                   for p in reference_greedy(model, batch, tokenizer, 8)]
    written = [i for i, p in enumerate(predictions) if len(tokenizer.encode(p)) < 8]
    assert len(written) >= 2, predictions  # (the tiny model rarely stops before 8 tokens)
    for i in written:
        rows[i]["target"] = predictions[i]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    word = predictions[written[0]]
    labelled = sum(predictions[i] == word for i in written)
    return (["--finetune-valid-data", str(path), "--label-words", word],
            f"exact match: {len(written) / 16:.4f} | label accuracy: {labelled / 16:.4f} | "
            f"16 examples |")


def final_generation(log):
    return re.findall(r"validation generation at iteration 4 \| (.*)", log.read_text())


def test_logged_exact_match_counts_the_right_predictions(single_log, train_data, tmp_path):
    """A validation file whose targets are what the final model writes, where it stops in
    time: the same 4 steps again (the same final model) score exactly those (at 0 exact, the
    cloze's, a wrong count would go unseen)."""
    single, _ = single_log
    flags, want = own_targets(finetune_argv(train_data), single["state"], train_data.spm,
                              tmp_path / "own.jsonl")
    log = tmp_path / "own.log"
    (again,) = run_workers(1, run_keeping_model, [finetune_argv(
        train_data, *flags, "--log-file", str(log))], timeout=600)[0]
    assert all(torch.equal(again["state"][k], v) for k, v in single["state"].items())
    assert final_generation(log) == [want]


@pytest.mark.slow
def test_pipeline_validation_scores_the_right_predictions(single_log, train_data, tmp_path):
    """PP 2: the stages decode the first stage's validation batches together (PipelineDecoder
    over each stage's own part, nothing gathered onto one stage) and score the one-process
    final model's own decodings, as one process does (non-zero exact match and label
    accuracy: at the cloze's 0 a wrong decoding would go unseen)."""
    single, _ = single_log
    flags, want = own_targets(finetune_argv(train_data), single["state"], train_data.spm,
                              tmp_path / "own.jsonl")
    log = tmp_path / "own_pp2.log"
    got = run_workers(2, run_pretrain, [finetune_argv(
        train_data, *flags, "--pipeline-model-parallel-size", "2", "--log-file", str(log))],
        timeout=900)
    assert got[0] == got[1]
    assert final_generation(log) == [want]


MOE = ("--num-experts", "4", "--moe-router-topk", "2")


@pytest.mark.slow
def test_expert_parallel_validation_matches_one_process(train_data, tmp_path):
    """EP 2 (DP 2: each rank decodes its half of the validation batches, the two in lockstep
    for the experts' all-to-alls): the losses and the generation metrics of one process, on a
    validation file that one process's final model scores non-zero on."""
    argv = finetune_argv(train_data, *MOE)
    (one,) = run_workers(1, run_keeping_model, [argv], timeout=600)[0]
    flags, want = own_targets(argv, one["state"], train_data.spm, tmp_path / "own.jsonl")
    logs = [tmp_path / "ep1.log", tmp_path / "ep2.log"]
    (one_again,) = run_workers(1, run_pretrain, [finetune_argv(
        train_data, *MOE, *flags, "--log-file", str(logs[0]))], timeout=600)[0]
    two = run_workers(2, run_pretrain, [finetune_argv(
        train_data, *MOE, *flags, "--expert-model-parallel-size", "2", "--log-file",
        str(logs[1]))], timeout=900)
    assert two[0] == two[1]
    assert_same_run(two[0][0], one_again, rtol=2e-5, label="EP 2")
    assert final_generation(logs[0]) == final_generation(logs[1]) == [want]
    assert generation_lines(logs[1].read_text()) == generation_lines(logs[0].read_text())


def test_finetuning_from_a_pretrained_checkpoint(train_data, tmp_path, single):
    ckpt = str(tmp_path / "pretrained")
    log = tmp_path / "finetune.log"
    argv = finetune_argv(train_data, "--load", ckpt, "--finetune", "--log-file", str(log))
    pretrained, tuned = run_workers(1, run_keeping_model, [
        base_argv(train_data, "--save", ckpt, "--save-interval", "2", iters=2), argv],
        timeout=600)[0]
    assert pretrained["iteration"] == 2
    # the schedule starts fresh: four steps of its own, from the pretrained weights
    assert sorted(tuned["losses"]) == [1, 2, 3, 4]
    assert "(--finetune: optimizer, LR schedule and data start fresh)" in log.read_text()
    # step 1's loss is the pretrained model's on the first global batch (two micro-batches of
    # 2: the step's loss is their mean; dropout 0)
    model = reference_model(argv, pretrained["state"])
    with torch.no_grad():
        want = sum(float(model(batch["encoder_input_ids"], batch["decoder_input_ids"],
                               batch["encoder_attention_mask"],
                               batch["decoder_attention_mask"], batch["labels"]).loss)
                   for batch in split_batches(argv, "train", 2, 2)) / 2
    assert tuned["losses"][1] == pytest.approx(want, rel=1e-6)
    assert tuned["losses"][1] != pytest.approx(single["losses"][1], rel=1e-3)


def test_bad_flags_are_refused_one_message_each(train_data, tmp_path):
    from megatron.arguments import ArgumentsError, parse_args

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input": "a", "target": "b"}\n{"input": "a", "label": "b"}\n')
    with pytest.raises(ArgumentsError) as e:
        parse_args(finetune_argv(train_data, "--data-path", train_data.prefix,
                                 "--finetune-valid-data", str(bad)), env={})
    assert e.value.problems == [
        "--finetune-data reads its pairs instead of --data-path: give one of them",
        f"--finetune-valid-data {bad} line 2: missing key 'target' (--target-key)"]
    argv = [a for a in finetune_argv(train_data) if a not in ("--decoder-seq-length", "8")]
    with pytest.raises(ArgumentsError) as e:
        parse_args(argv, env={})
    assert [p.split(" (")[0] for p in e.value.problems] == \
        ["--finetune-data needs --decoder-seq-length"]


def generation_lines(log: str):
    return re.findall(r"validation generation at iteration \d+ \| .*", log)


@pytest.mark.slow
def test_tensor_pipeline_and_zero_data_parallel_match_one_process(train_data, single_log,
                                                                   tmp_path):
    """Losses, and the validation's generation metrics (exact match, label accuracy), which
    ZeRO-3 and the pipeline compute on a gathered copy of the model (training/whole_model.py)."""
    single, log = single_log
    words = ["--label-words", "proceed", "resolved"]
    logged = {3: tmp_path / "zero3.log"}
    runs = [["--zero-stage", str(s), *words,
             *(["--log-file", str(logged[s])] if s in logged else [])] for s in (0, 1, 2, 3)]
    got = run_workers(2, run_pretrain, [finetune_argv(train_data, *r) for r in runs],
                      timeout=900)
    assert got[0] == got[1]
    for flags, result in zip(runs, got[0]):
        assert_same_run(result, single, rtol=2e-5, label=flags)
    pp_log = tmp_path / "pp2.log"
    layouts = [["--tensor-model-parallel-size", "2"],
               ["--pipeline-model-parallel-size", "2", *words, "--log-file", str(pp_log)]]
    got = run_workers(2, run_pretrain, [finetune_argv(train_data, *r) for r in layouts],
                      timeout=900)
    assert got[0] == got[1]
    for flags, result in zip(layouts, got[0]):
        assert_same_run(result, single, rtol=2e-5, label=flags)
    expected = generation_lines(log)
    assert len(expected) == 2
    for path in (logged[3], pp_log):
        assert generation_lines(path.read_text()) == expected, path.name


@pytest.mark.slow
def test_the_whole_copy_of_a_zero3_or_pipeline_model_is_the_one_process_model(train_data):
    """Validation's decoding under ZeRO-3 runs on training/whole_model.py's copy: each tensor
    equals the one-process model's of the same seed, on both ranks. In a pipeline (PP 2) each
    stage decodes with its own part (whole_model.py's stage_model): each stage holds exactly
    the tensors of its modules (Cut.stage_modules), each equal to the one-process model's,
    and together they hold all of them."""
    from megatron.arguments import parse_args
    from megatron.model.t5 import T5Model

    argv = finetune_argv(train_data)
    (want, itself), = run_workers(1, whole_model_state, argv, timeout=300)
    assert itself  # one process: the trained module, no copy
    zero3 = run_workers(2, whole_model_state, argv + ["--zero-stage", "3"], timeout=300)
    for got, copied in zero3:
        assert not copied
        assert sorted(got) == sorted(want)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)
    pp = argv + ["--pipeline-model-parallel-size", "2"]
    stages = run_workers(2, whole_model_state, pp, timeout=300)
    config = parse_args(pp, env={"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    cut, t5 = config.pipeline_cut(), config.model.t5
    meta = T5Model(t5, config.model.make_vocab_size_divisible_by, device="meta")
    for stage, (got, copied) in enumerate(stages):
        assert not copied
        modules = cut.stage_modules(stage, t5.tie_word_embeddings)
        assert set(got) == {f"{m}.{n}" for m in modules
                            for n in meta.get_submodule(m).state_dict()}, stage
        for name in got:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)
    assert set(stages[0][0]) | set(stages[1][0]) == set(want)
