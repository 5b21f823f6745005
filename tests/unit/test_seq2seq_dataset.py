"""Seq2seq pairs for fine-tuning (megatron/data/datasets/seq2seq.py): one example per row, padded
and masked as every pretraining sample, EOS kept at the end of a cut example; a JSONL file and
preprocess_data.py's pair of prefixes give the same samples; bad files named with their line."""

import json
from pathlib import Path

import numpy as np
import pytest

from megatron.data.data_args import finetune_problems
from megatron.data.datasets.seq2seq import (
    Seq2SeqConfig,
    Seq2SeqDataset,
    build_seq2seq_datasets,
    fit,
    is_scored,
    open_examples,
    source_problems,
)
from megatron.data.datasets.t5_dataset import IGNORE_INDEX, T5SpecialTokens
from megatron.data.tokenizers.tokenizer import TokenizerSpec, build_tokenizer

FINETUNE = Path(__file__).resolve().parents[1] / "data" / "finetune"
TRAIN, VALID = str(FINETUNE / "cloze_train.jsonl"), str(FINETUNE / "cloze_valid.jsonl")
ENC, DEC = 24, 6


@pytest.fixture(scope="module")
def tokenizer(spm_model):
    return build_tokenizer(TokenizerSpec("SentencePieceTokenizer", str(spm_model)))


@pytest.fixture(scope="module")
def tokens(tokenizer):
    return T5SpecialTokens.from_tokenizer(tokenizer)


def make(tokenizer, tokens, path=TRAIN, name="train", num_samples=200, enc=ENC, dec=DEC):
    return Seq2SeqDataset(name, open_examples(path, "input", "target", tokenizer), num_samples,
                          enc, dec, tokens, seed=3)


def test_fit_adds_eos_once_and_keeps_it_when_cutting():
    assert fit(np.array([5, 6]), 4, 1).tolist() == [5, 6, 1]
    assert fit(np.array([5, 6, 1]), 4, 1).tolist() == [5, 6, 1]
    assert fit(np.array([5, 6, 7, 8, 9]), 4, 1).tolist() == [5, 6, 7, 1]
    assert fit(np.array([], dtype=np.int64), 4, 1).tolist() == [1]


def test_a_sample_is_one_example_padded_and_masked(tokenizer, tokens):
    ds = make(tokenizer, tokens, path=VALID, name="valid", num_samples=20)
    rows = [json.loads(line) for line in open(VALID, encoding="utf-8")]
    assert sorted(ds[0]) == sorted(["encoder_input_ids", "decoder_input_ids", "labels",
                                    "encoder_attention_mask", "decoder_attention_mask"])
    for i in range(len(rows)):  # validation: file order
        row = rows[i]
        s = ds[i]
        want_in = fit(np.array(tokenizer.encode(row["input"])), ENC, tokens.eos_id)
        want_out = fit(np.array(tokenizer.encode(row["target"])), DEC, tokens.eos_id)
        n, m = len(want_in), len(want_out)
        assert s["encoder_input_ids"][:n].tolist() == want_in.tolist()
        assert (s["encoder_input_ids"][n:] == tokens.pad_id).all()
        assert s["encoder_attention_mask"].tolist() == [1] * n + [0] * (ENC - n)
        assert s["labels"].tolist() == want_out.tolist() + [IGNORE_INDEX] * (DEC - m)
        assert s["decoder_input_ids"][0] == tokens.decoder_start_token_id
        assert s["decoder_input_ids"][1:m].tolist() == want_out[:-1].tolist()  # shifted right
        assert s["decoder_attention_mask"].tolist() == [1] * m + [0] * (DEC - m)
        assert s["encoder_input_ids"].shape == (ENC,) and s["labels"].shape == (DEC,)
    # past the file's end (an evaluation of 20 samples over 16 examples): the batch keeps its
    # shape, and the repeated example is not scored a second time (issue 43 item 7: the first
    # 4 counted twice)
    for i in range(len(rows), 20):
        again, first = ds[i], ds[i - len(rows)]
        assert (again["labels"] == IGNORE_INDEX).all()
        assert again["encoder_input_ids"].tolist() == first["encoder_input_ids"].tolist()
        assert not is_scored(again["labels"]) and is_scored(first["labels"])
    # training cycles over the examples in epochs: every sample scored
    train = make(tokenizer, tokens, num_samples=130)
    assert all(is_scored(train[i]["labels"]) for i in range(64, 130))


def test_long_examples_are_cut_with_eos_last(tokenizer, tokens):
    ds = make(tokenizer, tokens, enc=6, dec=2)
    cut = 0
    for i in range(64):
        s = ds[i]
        n = int(s["encoder_attention_mask"].sum())
        assert s["encoder_input_ids"][n - 1] == tokens.eos_id
        assert s["labels"][s["labels"] != IGNORE_INDEX][-1] == tokens.eos_id
        cut += n == 6
    assert cut > 32


def test_training_order_is_a_seeded_permutation_per_epoch(tokenizer, tokens):
    ds = make(tokenizer, tokens)
    first = [ds.example_index(i) for i in range(64)]
    second = [ds.example_index(i) for i in range(64, 128)]
    assert sorted(first) == sorted(second) == list(range(64))
    assert first != list(range(64)) and first != second
    again = make(tokenizer, tokens)
    for i in (0, 5, 70, 199):  # a pure function of (seed, index), in any order
        assert all((again[i][k] == ds[i][k]).all() for k in ds[i])
    with pytest.raises(IndexError):
        ds[200]


def test_preprocessed_pair_gives_the_same_samples(tokenizer, tokens, spm_model, tmp_path):
    from data_tools import preprocess_data

    for eod in ([], ["--append-eod"]):
        prefix = tmp_path / f"cloze{len(eod)}"
        assert preprocess_data.main(["--input", TRAIN, "--output-prefix", str(prefix),
                                     "--json-keys", "input", "target",
                                     "--tokenizer-model", str(spm_model), "--workers", "1",
                                     "--no-progress", *eod]) == 0
        assert source_problems("--finetune-data", str(prefix), "input", "target") == []
        jsonl, pre = make(tokenizer, tokens), make(tokenizer, tokens, path=str(prefix))
        for i in range(0, 200, 7):
            assert all((jsonl[i][k] == pre[i][k]).all() for k in jsonl[i]), (eod, i)


def test_build_gives_train_and_valid(spm_model, tokens):
    config = Seq2SeqConfig(TRAIN, VALID, tokenizer=TokenizerSpec("SentencePieceTokenizer",
                                                                 str(spm_model)))
    out = build_seq2seq_datasets(config, ENC, DEC, 1, tokens, (40, 8, 4))
    assert len(out["train"]) == 40 and len(out["valid"]) == 8 and out["test"] is None
    out = build_seq2seq_datasets(Seq2SeqConfig(TRAIN, tokenizer=config.tokenizer), ENC, DEC, 1,
                                 tokens, (40, 8, 4))
    assert out["valid"] is None


def test_bad_files_are_named_with_their_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input": "a", "target": "b"}\n{"input": "a" "target"}\n')
    assert source_problems("--finetune-data", str(bad), "input", "target") == [
        f"--finetune-data {bad} line 2: invalid JSON: Expecting ',' delimiter at column 15"]
    bad.write_text('{"input": "a", "target": "b"}\n\n{"input": "a"}\n')
    assert source_problems("--finetune-valid-data", str(bad), "input", "target") == [
        f"--finetune-valid-data {bad} line 3: missing key 'target' (--target-key)"]
    bad.write_text('{"input": 3, "target": "b"}\n')
    assert "line 1: value of 'input' (--input-key) is int, not a string" in \
        source_problems("--finetune-data", str(bad), "input", "target")[0]
    missing = str(tmp_path / "nope.jsonl")
    assert source_problems("--finetune-data", missing, "input", "target") == [
        f"--finetune-data {missing}: no such file"]
    prefix = str(tmp_path / "nope")
    assert "neither a JSONL file nor a preprocessed pair" in \
        source_problems("--finetune-data", prefix, "input", "target")[0]


def test_flag_combinations_each_one_message():
    base = {"finetune_data": TRAIN, "decoder_seq_length": 8, "data_path": None,
            "t5_objective": "span-corruption", "input_key": "input", "target_key": "target"}
    assert finetune_problems(base) == []
    assert finetune_problems({**base, "data_path": ["x"]}) == [
        "--finetune-data reads its pairs instead of --data-path: give one of them"]
    assert finetune_problems({**base, "decoder_seq_length": None})[0].startswith(
        "--finetune-data needs --decoder-seq-length")
    assert finetune_problems({**base, "t5_objective": "ul2"})[0].startswith(
        "--t5-objective ul2 cannot read --finetune-data")
    assert finetune_problems({**base, "target_key": "input"}) == [
        "--input-key and --target-key are both 'input'"]
    assert finetune_problems({**base, "label_words": ["yes", "yes"]}) == [
        "--label-words has a word twice"]
    assert finetune_problems({"finetune_data": None, "finetune_valid_data": VALID,
                              "label_words": ["a"]}) == [
        "--finetune-valid-data needs --finetune-data", "--label-words needs --finetune-data"]
