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
    """One process, gradient accumulation 2, label words (two of the cloze targets), every
    task metric (--finetune-metrics; ROUGE-L and BLEU of characters): the result and the log;
    its TensorBoard folder beside the log (`tb`)."""
    out = tmp_path_factory.mktemp("finetune")
    log = out / "single.log"
    result = run_workers(1, run_keeping_model, [finetune_argv(
        train_data, *WORDS, *ALL_METRICS, *CHARS, "--log-file", str(log), "--tensorboard-dir",
        str(out / "tb"))], timeout=600)[0][0]
    result["tb"] = str(out / "tb")
    return result, log.read_text()


LABEL_WORDS = ["little", "think"]  # the first two validation targets
WORDS = ["--label-words", *LABEL_WORDS]
METRIC_NAMES = ("exact_match", "label_accuracy", "first_token_accuracy", "rouge_l", "bleu")
ALL_METRICS = ["--finetune-metrics", ",".join(METRIC_NAMES)]
CHARS = ["--eval-rouge-tokenize", "chars", "--eval-bleu-tokenize", "char"]
"""Characters: a 4-step model shares no word with the cloze targets, but letters (ROUGE-L and
BLEU non-zero)."""
LOGGED = {"exact match": "exact_match", "label accuracy": "label_accuracy",
          "first-token accuracy": "first_token_accuracy", "ROUGE-L": "rouge_l", "BLEU": "bleu"}


def logged_scores(line):
    """{metric: value, "examples": n} of a validation generation line's tail."""
    parts = [p.strip() for p in line.strip(" |").split(" | ")]
    out = {"examples": int(parts[-1].split()[0])}
    out.update({LOGGED[k]: float(v) for k, v in (p.split(": ") for p in parts[:-1])})
    return out


def reference_scores(model, batches, tokenizer, targets, label_words, beams=1,
                     rouge_chars=False, bleu_tokenize="13a"):
    """Every task metric of `model` (a reference_model) on `batches` (split_batches' 16
    validation examples) against `targets`, recomputed without megatron/evaluation: greedy
    decoding by `reference_greedy` (beams > 1: megatron/generation's beam search, which
    tests/generation checks against transformers), the first step's label word from the plain
    forward, ROUGE-L by rouge-score (`rouge_chars`: of characters), BLEU by sacrebleu."""
    import sacrebleu
    from rouge_score import rouge_scorer

    from megatron.generation import Decoder, DecodingSettings, SpecialTokens, beam_search

    predictions, first = [], []
    firsts = [tokenizer.encode(w)[0] for w in label_words]
    tokens = SpecialTokens(tokenizer.decoder_start_token_id, tokenizer.eos_id, tokenizer.pad_id)
    for batch in batches:
        ids, mask = batch["encoder_input_ids"], batch["encoder_attention_mask"]
        if beams == 1:
            predictions += reference_greedy(model, batch, tokenizer, 8)
        else:
            found = beam_search(Decoder(model, ids, mask, expand=beams), ids.shape[0], tokens,
                                DecodingSettings(max_new_tokens=8, num_beams=beams))
            predictions += [tokenizer.decode([i for i in h.ids if i not in tokens[1:]])
                            for h in found]
        start = torch.full((ids.shape[0], 1), tokens.start)
        with torch.no_grad():
            logits = model(ids, start, mask).logits[:, 0]
        first += [label_words[i] for i in logits[:, firsts].argmax(-1).tolist()]
    n = len(targets)
    class Characters:  # rouge-score's tokenizer interface
        def tokenize(self, text):
            return [c for c in text if not c.isspace()]

    scorer = rouge_scorer.RougeScorer(["rougeL"], tokenizer=Characters() if rouge_chars else None)
    return {"exact_match": sum(p.strip() == t for p, t in zip(predictions, targets)) / n,
            "label_accuracy": sum(p.strip() == t and t in label_words
                                  for p, t in zip(predictions, targets)) / n,
            "first_token_accuracy": sum(w == t for w, t in zip(first, targets)) / n,
            "rouge_l": sum(scorer.score(t, p)["rougeL"].fmeasure
                           for p, t in zip(predictions, targets)) / n,
            "bleu": sacrebleu.corpus_bleu(predictions, [targets],
                                          tokenize=bleu_tokenize).score,
            "examples": n}


def assert_scores(got, want):
    """A logged line's numbers (four decimals) are the reference's."""
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name] == pytest.approx(value, abs=6e-5), (name, got, want)


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
    # with the loss, every task metric (--finetune-metrics) of the greedy decoding over the
    # 16 validation examples, each once (eval_iters 5 x global batch 4 = 20 samples: the last
    # 4 repeat the first 4 and are not scored again), recomputed here from the final model
    lines = re.findall(r"validation generation at iteration (\d+) \| (.*)", log)
    assert [int(i) for i, _ in lines] == [2, 4]
    assert lines[1][1].startswith("exact match: ") and lines[1][1].endswith("16 examples |")
    tokenizer = build_tokenizer(resolve_tokenizer(train_data.spm))
    argv = finetune_argv(train_data)
    model = reference_model(argv, single["state"])
    targets = [json.loads(line)["target"] for line in open(VALID, encoding="utf-8")]
    want = reference_scores(model, split_batches(argv, "valid", 4, 4), tokenizer, targets,
                            LABEL_WORDS, rouge_chars=True, bleu_tokenize="char")
    assert_scores(logged_scores(lines[1][1]), want)
    assert want["rouge_l"] > 0 and want["bleu"] > 0 and want["first_token_accuracy"] > 0, want
    # TensorBoard: validation/<metric> at both validations, label accuracy also under its
    # first name validation/accuracy
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(single["tb"])
    events.Reload()
    for name in (*METRIC_NAMES, "accuracy"):
        scalars = events.Scalars(f"validation/{name}")
        assert [e.step for e in scalars] == [2, 4], name
        value = want["label_accuracy" if name == "accuracy" else name]
        assert scalars[1].value == pytest.approx(value, rel=1e-6, abs=1e-7), name
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
    tokenizer, _, rows, predictions, written = _write_own_targets(argv, state, spm, path)
    word = predictions[written[0]]
    labelled = sum(predictions[i] == word for i in written)
    return (["--finetune-valid-data", str(path), "--label-words", word],
            f"exact match: {len(written) / 16:.4f} | label accuracy: {labelled / 16:.4f} | "
            f"16 examples |")


def _write_own_targets(argv, state, spm, path):
    """own_targets' file; returns (tokenizer, the reference model, the file's rows, the
    model's decodings, the rows whose target is its decoding)."""
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
    return tokenizer, model, rows, predictions, written


def own_targets_scored(argv, state, spm, path):
    """As own_targets, with every task metric: (the flags: the file, two label words (the
    first own decoding and a cloze target that begins with another token), ALL_METRICS,
    ROUGE-L of characters (the model's decodings are seldom ASCII words), BLEU of 13a words;
    the numbers the final validation must log, reference_scores')."""
    tokenizer, model, rows, predictions, written = _write_own_targets(argv, state, spm, path)
    word = predictions[written[0]]
    other = next(r["target"] for i, r in enumerate(rows) if i not in written
                 and tokenizer.encode(r["target"])[0] != tokenizer.encode(word)[0])
    want = reference_scores(model, split_batches(argv, "valid", 4, 4), tokenizer,
                            [r["target"] for r in rows], [word, other], rouge_chars=True)
    assert want["exact_match"] > 0 and want["rouge_l"] > 0 and want["bleu"] > 0, want
    return (["--finetune-valid-data", str(path), "--label-words", word, other, *ALL_METRICS,
             "--eval-rouge-tokenize", "chars"], want)


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
    final model's own decodings, as one process does, with every task metric (non-zero exact
    match, ROUGE-L and BLEU: at the cloze's 0 a wrong decoding would go unseen)."""
    single, _ = single_log
    flags, want = own_targets_scored(finetune_argv(train_data), single["state"], train_data.spm,
                                     tmp_path / "own.jsonl")
    log = tmp_path / "own_pp2.log"
    got = run_workers(2, run_pretrain, [finetune_argv(
        train_data, *flags, "--pipeline-model-parallel-size", "2", "--log-file", str(log))],
        timeout=900)
    assert got[0] == got[1]
    (line,) = final_generation(log)
    assert_scores(logged_scores(line), want)


MOE = ("--num-experts", "4", "--moe-router-topk", "2")


@pytest.mark.slow
def test_expert_parallel_validation_matches_one_process(train_data, tmp_path):
    """EP 2 (DP 2: each rank decodes its half of the validation batches, the two in lockstep
    for the experts' all-to-alls): the losses and every task metric of one process, on a
    validation file that one process's final model scores non-zero on."""
    argv = finetune_argv(train_data, *MOE)
    (one,) = run_workers(1, run_keeping_model, [argv], timeout=600)[0]
    flags, want = own_targets_scored(argv, one["state"], train_data.spm,
                                     tmp_path / "own.jsonl")
    logs = [tmp_path / "ep1.log", tmp_path / "ep2.log"]
    (one_again,) = run_workers(1, run_pretrain, [finetune_argv(
        train_data, *MOE, *flags, "--log-file", str(logs[0]))], timeout=600)[0]
    two = run_workers(2, run_pretrain, [finetune_argv(
        train_data, *MOE, *flags, "--expert-model-parallel-size", "2", "--log-file",
        str(logs[1]))], timeout=900)
    assert two[0] == two[1]
    assert_same_run(two[0][0], one_again, rtol=2e-5, label="EP 2")
    (line,) = final_generation(logs[0])
    assert_scores(logged_scores(line), want)
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


def test_bad_metric_flags_are_listed_with_the_other_problems(train_data):
    """--finetune-metrics and the --eval-* flags: each problem one line naming its flag,
    listed by validate() with the command line's others (exit 2 at the entry point); label
    words that begin with the same token of the run's tokenizer are refused by name."""
    from megatron.arguments import ArgumentsError, parse_args

    with pytest.raises(ArgumentsError) as e:
        parse_args(finetune_argv(train_data, "--finetune-metrics", "bleu,first_token_accuracy,f1",
                                 "--eval-num-beams", "0", "--eval-rouge-tokenize", "chars",
                                 "--num-workers", "-1"), env={})
    assert e.value.problems == [
        "--num-workers must be >= 0",
        "--finetune-metrics: unknown metric 'f1' (choose from exact_match, label_accuracy, "
        "first_token_accuracy, rouge_l, bleu)",
        "--finetune-metrics first_token_accuracy needs --label-words (the label task's words)",
        "--eval-num-beams must be at least 1, not 0",
        "--eval-rouge-tokenize needs rouge_l in --finetune-metrics"]
    # the session's SentencePiece vocabulary begins 是 and 否 with the same lone '▁' piece
    with pytest.raises(ArgumentsError) as e:
        parse_args(finetune_argv(train_data, "--label-words", "是", "否", "--finetune-metrics",
                                 "first_token_accuracy"), env={})
    (problem,) = e.value.problems
    assert problem.startswith("--label-words: '是' and '否' begin with the same token (id ")
    # the same words with label_accuracy alone (no first token read) are fine
    config = parse_args(finetune_argv(train_data, "--label-words", "是", "否",
                                      "--finetune-metrics", "label_accuracy,bleu",
                                      "--eval-num-beams", "3", "--eval-bleu-tokenize", "zh"),
                        env={})
    seq2seq = config.data.dataset.seq2seq
    assert (seq2seq.metrics, seq2seq.eval_num_beams, seq2seq.bleu_tokenize) == \
        (("label_accuracy", "bleu"), 3, "zh")


def generation_lines(log: str):
    return re.findall(r"validation generation at iteration \d+ \| .*", log)


@pytest.mark.slow
def test_tensor_pipeline_and_zero_data_parallel_match_one_process(train_data, single_log,
                                                                   tmp_path):
    """Losses, and every task metric of the validation (--finetune-metrics: exact match,
    label and first-token accuracy, ROUGE-L, BLEU, summed over data-parallel ranks), which
    ZeRO-3 and the pipeline compute on a gathered copy of the model (training/whole_model.py):
    the one-process run's line at ZeRO-3 (DP 2), TP 2 and PP 2. ZeRO-1 (DP 2) validates with
    beam search (--eval-num-beams 2): the one-process final model's beams, scored by the
    libraries."""
    single, log = single_log
    words = [*WORDS, *ALL_METRICS, *CHARS]
    logged = {1: tmp_path / "zero1_beams.log", 3: tmp_path / "zero3.log"}
    runs = [["--zero-stage", str(s), *words,
             *(["--log-file", str(logged[s])] if s in logged else []),
             *(["--eval-num-beams", "2"] if s == 1 else [])] for s in (0, 1, 2, 3)]
    got = run_workers(2, run_pretrain, [finetune_argv(train_data, *r) for r in runs],
                      timeout=900)
    assert got[0] == got[1]
    for flags, result in zip(runs, got[0]):
        assert_same_run(result, single, rtol=2e-5, label=flags)
    pp_log, tp_log = tmp_path / "pp2.log", tmp_path / "tp2.log"
    layouts = [["--tensor-model-parallel-size", "2", *words, "--log-file", str(tp_log)],
               ["--pipeline-model-parallel-size", "2", *words, "--log-file", str(pp_log)]]
    got = run_workers(2, run_pretrain, [finetune_argv(train_data, *r) for r in layouts],
                      timeout=900)
    assert got[0] == got[1]
    for flags, result in zip(layouts, got[0]):
        assert_same_run(result, single, rtol=2e-5, label=flags)
    expected = generation_lines(log)
    assert len(expected) == 2 and "BLEU: " in expected[1]
    for path in (logged[3], tp_log, pp_log):
        assert generation_lines(path.read_text()) == expected, path.name
    argv = finetune_argv(train_data)
    targets = [json.loads(line)["target"] for line in open(VALID, encoding="utf-8")]
    want = reference_scores(reference_model(argv, single["state"]),
                            split_batches(argv, "valid", 4, 4),
                            build_tokenizer(resolve_tokenizer(train_data.spm)), targets,
                            LABEL_WORDS, beams=2, rouge_chars=True, bleu_tokenize="char")
    (line,) = final_generation(logged[1])
    assert_scores(logged_scores(line), want)


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
