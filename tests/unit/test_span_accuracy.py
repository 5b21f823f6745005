"""Span-filling accuracy by hand on a fixed batch (megatron/training/step.py): the greedy
prediction is known from the logits, padding does not count, a padded vocabulary row is never
predicted even with the largest logit, and ties go to the lowest id."""

import torch

from megatron.tensor_parallel.group import SINGLE
from megatron.training.step import (SPAN_CORRECT, SPAN_TOKENS, greedy_tokens,
                                    span_accuracy_counts, span_accuracy_metrics)

VOCAB = 5  # the tokenizer's ids 0..4; the table is padded to 6 rows (id 5 is padding)


def fixed_batch():
    """logits [2, 3, 6] with one peak per position; labels [2, 3] with one padded position."""
    peaks = [[1, 4, 2],
             [3, 0, 4]]  # the greedy prediction among ids < VOCAB
    logits = torch.zeros(2, 3, VOCAB + 1)
    for b in range(2):
        for t in range(3):
            logits[b, t, peaks[b][t]] = 5.0
    logits[..., VOCAB] = 100.0  # the padded row: the largest logit everywhere
    labels = torch.tensor([[1, 3, 2],        # right, wrong, right
                           [3, 4, -100]])    # right, wrong, padding (prediction 4 ignored)
    return logits, labels, torch.tensor(peaks)


def test_greedy_prediction_skips_the_padded_row():
    logits, _, peaks = fixed_batch()
    assert torch.equal(greedy_tokens(logits, VOCAB, SINGLE), peaks)


def test_span_accuracy_counts_by_hand():
    logits, labels, peaks = fixed_batch()
    counts = span_accuracy_counts(logits, labels, VOCAB, SINGLE)
    assert int(counts.correct) == 3  # (0,0), (0,2), (1,0)
    assert int(counts.total) == 5  # the padded position does not count
    assert torch.equal(counts.predictions, peaks)


def test_a_row_of_padding_counts_nothing():
    logits, labels, _ = fixed_batch()
    labels[1, :] = -100
    counts = span_accuracy_counts(logits, labels, VOCAB, SINGLE)
    assert (int(counts.correct), int(counts.total)) == (2, 3)


def test_ties_go_to_the_lowest_id_and_half_precision_works():
    logits = torch.zeros(1, 1, 8, dtype=torch.bfloat16)
    logits[0, 0, [2, 6]] = 1.0
    assert greedy_tokens(logits, 8, SINGLE).tolist() == [[2]]
    counts = span_accuracy_counts(logits, torch.tensor([[6]]), 8, SINGLE)
    assert (int(counts.correct), int(counts.total)) == (0, 1)


def test_metrics_are_sums_by_name():
    metrics = span_accuracy_metrics(torch.tensor(3), torch.tensor(5))
    assert sorted(metrics) == sorted([SPAN_CORRECT, SPAN_TOKENS])
    assert {m.reduce for m in metrics.values()} == {"sum"}
    assert metrics[SPAN_CORRECT].value.dtype == torch.float64
    assert float(metrics[SPAN_CORRECT].value) / float(metrics[SPAN_TOKENS].value) == 0.6


def test_the_validation_line_adds_the_accuracy_after_the_perplexity(tmp_path, capsys):
    from megatron.training.metrics import MetricsWriter

    writer = MetricsWriter(None, tmp_path / "tb", enabled=True)
    writer.write_eval(20, "valid", 3.21)
    writer.write_eval(20, "valid", 3.21, span_accuracy=0.123456)
    writer.write_eval_samples(20, "valid",
                              [("a <extra_id_0> c", "<extra_id_0> b", "<extra_id_0> x\ny")])
    writer.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        " validation loss at iteration 20 | lm loss: 3.2100E+00 | lm loss PPL: 2.4779E+01 |",
        " validation loss at iteration 20 | lm loss: 3.2100E+00 | lm loss PPL: 2.4779E+01 |"
        " span accuracy: 0.1235 |",
        "sample 0 input: a <extra_id_0> c",
        "sample 0 target: <extra_id_0> b",
        "sample 0 fill: <extra_id_0> x\\ny"]  # one line per field
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, round(e.value, 6)) for e in acc.Scalars("valid/span_accuracy")] == \
        [(20, 0.123456)]
    text, = acc.Tensors("valid/samples/text_summary")
    assert text.step == 20
    assert b"    sample 0 target: <extra_id_0> b" in text.tensor_proto.string_val[0]


def test_decoded_samples_drop_padding_and_name_unknown_ids():
    from megatron.training.loop import decode_samples

    class Letters:  # ids 0..3 -> "abcd"
        def __len__(self):
            return 4

        def decode(self, ids):
            return "".join("abcd"[i] for i in ids)

    batch = {"encoder_input_ids": torch.tensor([[1, 2, 0], [3, 3, 3]]),
             "encoder_attention_mask": torch.tensor([[1, 1, 0], [1, 1, 1]]),
             "labels": torch.tensor([[2, 1, -100], [0, -100, -100]])}
    predictions = torch.tensor([[2, 7, 3], [1, 0, 0]])
    assert decode_samples(batch, predictions, Letters(), 5) == [
        ("bc", "cb", "c<id 7>"), ("ddd", "a", "b")]
    assert decode_samples(batch, predictions, Letters(), 1) == [("bc", "cb", "c<id 7>")]
