"""Evaluation's span-filling accuracy and --eval-log-samples (megatron/training/step.py,
loop.py): the greedy prediction over vocabulary-parallel logits is the unsplit one at TP=2
(padded rows never predicted, ties to the lowest id), and a run reports the same accuracy at
TP=1, TP=2 and PP=2, prints it after the perplexity and logs decoded samples from rank 0 at
every evaluation, the final validation and test evaluations too."""

import re

import pytest

from harness import run_workers
from train_workers import (base_argv, reference_model, run_keeping_model, run_pretrain,
                           split_batches)

# a learning rate at which 4 steps of the tiny model predict some target tokens (the sentinels)
# right: at base_argv's, every accuracy is 0 and agrees with anything
LEARNS = ("--lr", "3e-2")
VOCAB, PADDED = 13, 16  # 8 columns per rank at TP=2; the second rank's last 3 are padding


def full_logits():
    """[3, 5, PADDED] logits with ties inside and across the two halves and a padded column
    holding the largest value, and labels with padding."""
    import torch

    g = torch.Generator().manual_seed(3)
    logits = torch.randint(0, 4, (3, 5, PADDED), generator=g).float()
    logits[..., VOCAB:] = 9.0  # padding: never predicted
    logits[0, 0, :VOCAB] = 0.0
    logits[0, 0, [10, 5, 12]] = 4.0  # a tie across the halves: id 5 wins
    logits[0, 1, :VOCAB] = 0.0
    logits[0, 1, [9, 11]] = 4.0  # a tie inside the second half: id 9 wins
    labels = torch.randint(0, VOCAB, (3, 5), generator=g)
    labels[2, 3:] = -100
    labels[0, 0], labels[0, 1] = 5, 11
    return logits, labels


def greedy_at_tp2(rank, world_size):
    import torch.distributed as dist

    from megatron.tensor_parallel.group import TensorParallel
    from megatron.training.step import span_accuracy_counts

    logits, labels = full_logits()
    shard = logits[..., rank * PADDED // 2:(rank + 1) * PADDED // 2].contiguous()
    counts = span_accuracy_counts(shard, labels, VOCAB,
                                  TensorParallel(world_size, rank, dist.group.WORLD))
    return {"correct": counts.correct, "total": counts.total,
            "predictions": counts.predictions}


def test_greedy_prediction_at_tp2_is_the_unsplit_one():
    import torch

    from megatron.tensor_parallel.group import SINGLE
    from megatron.training.step import span_accuracy_counts

    logits, labels = full_logits()
    want = span_accuracy_counts(logits, labels, VOCAB, SINGLE)
    assert want.predictions[0, :2].tolist() == [5, 9]
    assert int(want.predictions.max()) < VOCAB
    assert int(want.total) == 13
    for got in run_workers(2, greedy_at_tp2, timeout=120):
        assert torch.equal(got["predictions"], want.predictions)
        assert (int(got["correct"]), int(got["total"])) == (int(want.correct),
                                                            int(want.total))


def accuracies(result):
    """(iteration, accuracy) of the loop's evaluations (the 4-tuples)."""
    return [(e[0], e[3]) for e in result["evals"] if len(e) > 3]


@pytest.fixture(scope="module")
def single(train_data, tmp_path_factory):
    log = tmp_path_factory.mktemp("eval_accuracy") / "single.log"
    result = run_workers(1, run_keeping_model, [base_argv(train_data, *LEARNS,
                                                          "--eval-log-samples", "2",
                                                          "--log-file", str(log))],
                         timeout=300)[0][0]
    return result, log.read_text()


def test_accuracy_and_samples_are_logged(single, train_data):
    import torch

    result, log = single
    got = [(e[0], e[3]) for e in result["evals"] if e[1] == "valid"]
    assert [i for i, _ in got] == [2, 4]  # the loop's evaluation and the final one
    # the final one recounted from the final model on the same batch (eval_iters 1 x global
    # batch 4 of the validation split): teacher-forced argmax over the real vocabulary
    argv = base_argv(train_data, *LEARNS)
    model = reference_model(argv, result["state"])
    right = total = 0
    with torch.no_grad():
        for batch in split_batches(argv, "valid", 2, 2):
            logits = model(batch["encoder_input_ids"], batch["decoder_input_ids"],
                           batch["encoder_attention_mask"], batch["decoder_attention_mask"],
                           ).logits[..., :model.config.vocab_size]
            labelled = batch["labels"] != -100
            right += int((logits.argmax(-1) == batch["labels"])[labelled].sum())
            total += int(labelled.sum())
    assert right > 0 and got[1][1] == right / total, (right, total, got)
    line = next(line for line in log.splitlines() if "validation loss at iteration 2" in line)
    assert re.fullmatch(r" validation loss at iteration 2 \| lm loss: \S+ \| lm loss PPL: \S+ "
                        r"\| span accuracy: \d\.\d{4} \|", line), line
    assert line.endswith(f"| span accuracy: {got[0][1]:.4f} |")
    # every evaluation logs its samples after its loss line: the loop's at 2 and the final
    # validation and test evaluations at 4 (what --eval-log-samples promises)
    lines = log.splitlines()
    evaluations = [i for i, line in enumerate(lines)
                   if re.match(r" (validation|test) loss at iteration", line)]
    assert [lines[i].split(" |")[0].strip() for i in evaluations] == [
        "validation loss at iteration 2", "validation loss at iteration 4",
        "test loss at iteration 4"], lines
    for i in evaluations:
        logged = [re.match(r"sample (\d+) (\w+): ", line) for line in lines[i + 1:i + 7]]
        assert [m and m.groups() for m in logged] == [
            (k, field) for k in "01" for field in ("input", "target", "fill")], lines[i:i + 7]
    assert "sample 2 input" not in log
    assert re.search(r"^sample 0 input: .*<extra_id_0>", log, re.M)
    assert re.search(r"^sample 0 target: <extra_id_0>", log, re.M)


@pytest.mark.parametrize("layout", [["--tensor-model-parallel-size", "2"],
                                    ["--pipeline-model-parallel-size", "2"]],
                         ids=["tp2", "pp2"])
def test_accuracy_is_the_same_at_tp2_and_pp2(train_data, single, layout, tmp_path):
    log = tmp_path / "run.log"
    argv = base_argv(train_data, *LEARNS, "--eval-log-samples", "1", "--log-file", str(log),
                     *layout)
    got = run_workers(2, run_pretrain, [argv], timeout=600)
    assert accuracies(got[0][0]) == accuracies(got[1][0])
    want = accuracies(single[0])
    assert [i for i, _ in accuracies(got[0][0])] == [i for i, _ in want]
    # the logits differ in the last bits between layouts: a near tie may turn at most a token
    assert [a for _, a in accuracies(got[0][0])] == pytest.approx([a for _, a in want],
                                                                  abs=0.01)
    text = log.read_text()
    assert len(re.findall(r"^sample 0 fill: ", text, re.M)) == 3  # validation 2 and 4, test 4
    assert "sample 1 input" not in text
    # rank 0 reads the same first batch as one process does
    assert re.findall(r"^sample 0 (?:input|target): .*$", text, re.M) == \
        re.findall(r"^sample 0 (?:input|target): .*$", single[1], re.M)
