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
    with pytest.raises(ValueError, match=r"p.jsonl line 2: missing key 'prediction'$"):
        read_predictions(str(bad))


def test_generation_counts_score_the_greedy_decoding(spm_model):
    """generation_counts on a tiny random model: the targets set to the model's own greedy
    output are all exact; the cloze targets (none of them what a random model writes) none."""
    import numpy as np
    import torch

    from megatron.data.datasets.seq2seq import Seq2SeqDataset, open_examples
    from megatron.data.datasets.t5_dataset import T5SpecialTokens, collate, make_sample
    from megatron.data.tokenizers.tokenizer import T5Tokenizer
    from megatron.model import T5Config, T5Model
    from megatron.training.finetune_metrics import generation_counts, greedy_predictions, rates

    torch.manual_seed(0)
    config = T5Config(vocab_size=4100, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                      num_decoder_layers=2, num_heads=4, feed_forward_proj="gated-gelu",
                      tie_word_embeddings=False, dropout_rate=0.0)
    model = T5Model(config, make_vocab_size_divisible_by=1).eval()
    tokenizer = T5Tokenizer(str(spm_model))
    tokens = T5SpecialTokens.from_tokenizer(tokenizer)
    valid = str(PREDICTIONS.parent / "cloze_valid.jsonl")
    ds = Seq2SeqDataset("valid", open_examples(valid, "input", "target", tokenizer), 8, 24, 6,
                        tokens)
    batch = {k: torch.from_numpy(v) for k, v in collate([ds[i] for i in range(8)]).items()}
    predicted = greedy_predictions(model, batch, tokenizer, max_new_tokens=5)
    assert len(predicted) == 8
    counts = generation_counts(model, [batch], tokenizer, 5)
    assert counts == {"examples": 8, "exact": 0}
    # targets = the model's own greedy ids: every prediction exact, and a label when listed
    own = []
    for i, text in enumerate(predicted):
        ids = np.array(tokenizer.encode(text) + [tokenizer.eos_id])
        own.append(make_sample(batch["encoder_input_ids"][i].numpy()[:1], ids[:6], 24, 6,
                               tokens.pad_id, tokens.decoder_start_token_id))
    own = {k: torch.from_numpy(v) for k, v in collate(own).items()}
    own["encoder_input_ids"] = batch["encoder_input_ids"]
    own["encoder_attention_mask"] = batch["encoder_attention_mask"]
    counts = generation_counts(model, [own], tokenizer, 5, label_words=[predicted[0]])
    assert counts["examples"] == 8 and counts["exact"] == 8
    assert counts["label_right"] == sum(p == predicted[0] for p in predicted)
    assert rates(counts)["exact_match"] == 1.0
    assert rates({"examples": 0}) == {}
    # rows without labels (validation past the file's end) are decoded but not counted
    own["labels"][5:] = -100
    assert generation_counts(model, [own], tokenizer, 5) == {"examples": 5, "exact": 5}
    assert rates({"examples": 5, "exact": 4})["examples"] == 5
