"""Exact match and label accuracy (megatron/training/finetune_metrics.py), counted by hand on the
fixed prediction file tests/data/finetune/predictions.jsonl."""

from pathlib import Path

import pytest

from megatron.training.finetune_metrics import (
    as_label,
    exact_match,
    generation_metrics,
    label_accuracy,
    read_predictions,
)

PREDICTIONS = Path(__file__).resolve().parents[1] / "data" / "finetune" / "predictions.jsonl"

# row by row: (target, prediction) -> exact match, label (yes/no/maybe) right
#   yes / "yes"   1 1        no / "no "   1 1 (whitespace ignored)
#   no / "yes"    0 0        maybe / "maybe" 1 1
#   yes / "Yes"   0 0 (case counts: no label word)    no / "nope"  0 0
#   yes / " yes"  1 1        no / ""      0 0


def test_exact_match_on_the_fixed_file():
    predictions, targets = read_predictions(str(PREDICTIONS))
    assert len(predictions) == 8
    assert exact_match(predictions, targets) == 4 / 8


def test_label_accuracy_on_the_fixed_file():
    predictions, targets = read_predictions(str(PREDICTIONS))
    assert label_accuracy(predictions, targets, ["yes", "no", "maybe"]) == 4 / 8
    # "maybe" is no label word now: that prediction is wrong though it equals its target
    assert label_accuracy(predictions, targets, ["yes", "no"]) == 3 / 8
    assert generation_metrics(predictions, targets, ["yes", "no"]) == \
        {"exact_match": 0.5, "accuracy": 3 / 8}
    assert generation_metrics(predictions, targets) == {"exact_match": 0.5}


def test_a_prediction_counts_as_the_label_word_it_equals():
    assert as_label(" no\n", ["yes", "no"]) == "no"
    assert as_label("no.", ["yes", "no"]) is None
    assert label_accuracy(["no"], ["yes"], ["yes", "no"]) == 0.0


def test_bad_inputs_are_named(tmp_path):
    with pytest.raises(ValueError, match="2 predictions for 1 targets"):
        exact_match(["a", "b"], ["a"])
    with pytest.raises(ValueError, match="needs --label-words"):
        label_accuracy(["a"], ["a"], [])
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"target": "a", "prediction": "a"}\n{"target": "a"}\n')
    with pytest.raises(ValueError, match=r"p.jsonl line 2: no string 'prediction'"):
        read_predictions(str(bad))
