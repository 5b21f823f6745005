"""Generation metrics of seq2seq fine-tuning's validation (docs/finetuning.md).

- exact match: the fraction of examples whose decoded prediction equals the decoded target,
  both stripped of surrounding whitespace (nothing else is normalised: case and punctuation
  count);
- label accuracy (`--label-words`): a prediction counts as the label word it equals (stripped),
  and is right when that word is the example's target; a prediction equal to no label word is
  wrong, whatever the target.

Both take plain strings, so the same functions score a validation's greedy decoding and a
prediction file written by `python -m megatron.generate`.
"""

from __future__ import annotations

import json
from typing import Dict, List, Optional, Sequence, Tuple


def _checked(predictions: Sequence[str], targets: Sequence[str]) -> None:
    if len(predictions) != len(targets):
        raise ValueError(f"{len(predictions)} predictions for {len(targets)} targets")
    if not predictions:
        raise ValueError("no predictions to score")


def exact_match(predictions: Sequence[str], targets: Sequence[str]) -> float:
    """Fraction of predictions equal to their target (surrounding whitespace ignored)."""
    _checked(predictions, targets)
    return sum(p.strip() == t.strip() for p, t in zip(predictions, targets)) / len(targets)


def as_label(prediction: str, label_words: Sequence[str]) -> Optional[str]:
    """The label word `prediction` equals (stripped), or None."""
    text = prediction.strip()
    for word in label_words:
        if text == word.strip():
            return word
    return None


def label_accuracy(predictions: Sequence[str], targets: Sequence[str],
                   label_words: Sequence[str]) -> float:
    """Fraction of predictions that are a label word and the one of their target."""
    _checked(predictions, targets)
    if not label_words:
        raise ValueError("label accuracy needs --label-words")
    right = 0
    for prediction, target in zip(predictions, targets):
        label = as_label(prediction, label_words)
        right += label is not None and label.strip() == target.strip()
    return right / len(targets)


def generation_metrics(predictions: Sequence[str], targets: Sequence[str],
                       label_words: Sequence[str] = ()) -> Dict[str, float]:
    """{"exact_match": ..., and with label words "accuracy": ...}."""
    out = {"exact_match": exact_match(predictions, targets)}
    if label_words:
        out["accuracy"] = label_accuracy(predictions, targets, label_words)
    return out


def read_predictions(path: str, prediction_key: str = "prediction",
                     target_key: str = "target") -> Tuple[List[str], List[str]]:
    """(predictions, targets) of a JSONL file, one object per line.

    Raises:
        ValueError: naming the file and line: not JSON, a key missing or not a string.
    """
    predictions, targets = [], []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path} line {number}: not JSON ({e})") from None
            for key, into in ((prediction_key, predictions), (target_key, targets)):
                if not isinstance(record, dict) or not isinstance(record.get(key), str):
                    raise ValueError(f"{path} line {number}: no string {key!r}")
                into.append(record[key])
    return predictions, targets
