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


def _tiny_model_and_batch(spm_model, rows=8):
    """A tiny random model (sharpened as tests/generation's are, so that beams differ from
    greedy), the session tokenizer, and the first `rows` validation pairs as one batch."""
    import torch

    from megatron.data.datasets.seq2seq import Seq2SeqDataset, open_examples
    from megatron.data.datasets.t5_dataset import T5SpecialTokens, collate
    from megatron.data.tokenizers.tokenizer import T5Tokenizer
    from megatron.model import T5Config, T5Model

    torch.manual_seed(0)
    fields = dict(vocab_size=4100, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                  num_decoder_layers=2, num_heads=4, feed_forward_proj="gated-gelu",
                  tie_word_embeddings=False, dropout_rate=0.0)
    model = T5Model(T5Config(**fields), make_vocab_size_divisible_by=1).eval()
    with torch.no_grad():
        model.shared.weight.mul_(3.0)
        model.lm_head.weight.mul_(3.0)
    tokenizer = T5Tokenizer(str(spm_model))
    tokens = T5SpecialTokens.from_tokenizer(tokenizer)
    valid = str(PREDICTIONS.parent / "cloze_valid.jsonl")
    ds = Seq2SeqDataset("valid", open_examples(valid, "input", "target", tokenizer), rows, 24, 6,
                        tokens)
    batch = {k: torch.from_numpy(v) for k, v in collate([ds[i] for i in range(rows)]).items()}
    return model, fields, tokenizer, batch


def test_beam_validation_scores_transformers_beam_search(spm_model):
    """--eval-num-beams 3: the statistics of generation_counts are those of transformers'
    beam search (`generate(num_beams=3)`, the same weights) scored by task_metrics; and beam
    search decodes otherwise than greedy here (else the check could not tell them apart)."""
    import torch
    from transformers import T5Config as HFConfig
    from transformers import T5ForConditionalGeneration

    from megatron.evaluation import task_metrics
    from megatron.model import T5Config
    from megatron.model.state_dict import to_hf_state_dict
    from megatron.training.finetune_metrics import (Scoring, decoded, decoded_targets,
                                                    generation_counts, greedy_predictions)

    model, fields, tokenizer, batch = _tiny_model_and_batch(spm_model)
    start, eos, pad = tokenizer.decoder_start_token_id, tokenizer.eos_id, tokenizer.pad_id
    hf = T5ForConditionalGeneration(HFConfig(**fields, attn_implementation="eager",
                                             eos_token_id=eos, pad_token_id=pad,
                                             decoder_start_token_id=start))
    hf.lm_head.weight = torch.nn.Parameter(torch.empty_like(hf.lm_head.weight))
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(model.state_dict(),
                                                              T5Config(**fields)), strict=False)
    assert not missing and not unexpected
    with torch.no_grad():
        out = hf.eval().generate(input_ids=batch["encoder_input_ids"],
                                 attention_mask=batch["encoder_attention_mask"],
                                 max_new_tokens=5, num_beams=3, do_sample=False,
                                 length_penalty=1.0, early_stopping=False, use_cache=False)
    beams = [tokenizer.decode([i for i in row[1:] if i not in (eos, pad)])
             for row in out.tolist()]
    assert beams != greedy_predictions(model, batch, tokenizer, 5)
    scoring = Scoring.of(("exact_match", "rouge_l", "bleu"), num_beams=3)
    assert decoded(model, batch, tokenizer, scoring, 5)[0] == beams
    want = task_metrics.statistics(scoring, beams, decoded_targets(batch, tokenizer))
    assert want["bleu_sys_len"] > 0
    assert generation_counts(model, [batch], tokenizer, 5, scoring=scoring) == want
    # and the targets set to those beams: all exact, ROUGE-L 1, BLEU 100 (where 4-grams exist)
    assert task_metrics.scores(scoring, task_metrics.statistics(scoring, beams, beams))[
        "exact_match"] == 1.0


def test_first_token_accuracy_reads_the_first_decoder_step(spm_model):
    """first_token_accuracy: each row's label word is the one whose first token scores
    highest at the first decoder step (the model's plain forward over the decoder start), and
    only that step runs (no generated text)."""
    import torch

    from megatron.training.finetune_metrics import (Scoring, decoded, decoded_targets,
                                                    generation_counts)

    model, _, tokenizer, batch = _tiny_model_and_batch(spm_model)
    targets = decoded_targets(batch, tokenizer)
    start = torch.full((batch["encoder_input_ids"].shape[0], 1), tokenizer.decoder_start_token_id)
    with torch.no_grad():
        logits = model(batch["encoder_input_ids"], start, batch["encoder_attention_mask"]).logits
    # two of the targets as label words, the first pair whose choice differs between rows (so
    # that a row scored with another row's logits would show)
    pairs = [(a, b) for a in targets for b in targets
             if tokenizer.encode(a)[0] < tokenizer.encode(b)[0]]
    for words in pairs:
        firsts = [tokenizer.encode(w)[0] for w in words]
        chosen = [words[i] for i in logits[:, 0, firsts].argmax(-1).tolist()]
        if len(set(chosen)) == 2 and any(c == t for c, t in zip(chosen, targets)):
            break
    else:
        raise AssertionError("no pair of label words whose choice depends on the row")
    right = sum(c == t for c, t in zip(chosen, targets))
    scoring = Scoring.of(("first_token_accuracy",), words)
    counts = generation_counts(model, [batch], tokenizer, 5, scoring=scoring)
    assert counts == {"examples": 8, "first_token_right": right}
    # row by row, the first step's logits are the plain forward's, alone and under beam search
    # (asked for the generated metrics)
    both = Scoring.of(("exact_match", "first_token_accuracy"), words, num_beams=2)
    for how in (scoring, both):
        texts, first = decoded(model, batch, tokenizer, how, 5)
        assert (texts is None) == (how is scoring)
        torch.testing.assert_close(first, logits[:, 0, :first.shape[1]], rtol=1e-5, atol=1e-5)
    assert generation_counts(model, [batch], tokenizer, 5,
                             scoring=both)["first_token_right"] == right
