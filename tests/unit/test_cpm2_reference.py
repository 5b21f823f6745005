"""CPM2Dataset against CPM-2-Pretrain itself: the data in tests/data/cpm2/three_files was made by
CPM-2's own `src/tools/preprocess_data_enc_dec.py`, and `reference.npz` there holds what CPM-2's
own `src/data/enc_dec_dataset.py` (with the masks of `src/pretrain_enc_dec.py`) yields for every
window of two configurations (both made by tests/data/cpm2/make_three_file_fixture.py; see the
README there). Our reader, configured as CPM-2 is (lengths, seed, split, sample counts, bpe_cn's
special ids), must give the same samples, field by field.

Their fields and ours:
    contexts        encoder_input_ids
    targets         decoder_input_ids (both padded with <pad>)
    labels          labels, but ours are -100 wherever their loss_mask is 0 (padding, and after
                    <eod> in the decoder input); theirs keep the token / <pad> there
    ctx_eod_mask    encoder_eod_mask (with return_encoder_eod_mask)
    loss_mask       labels != -100
    enc / cross_attention_mask [rows, enc]   encoder_attention_mask as the keys' mask (all ones:
                    a window is never padded)
    dec_attention_mask [dec, dec]            causal & decoder_attention_mask on the keys: equal
                    on every row with a real decoder token; their padding rows also see the
                    padding keys (those rows carry no loss)
    enc / dec_position_ids                   plain 0..L-1 (no --reset-position-ids); our model has
                    no position ids, its relative attention bias uses the same positions

Where the two legitimately differ: `len()`: theirs counts every window of every epoch, ours is
the number of samples asked for (windows past it are reached through `window(shuffle_idx[i])`
here); their doc_idx holds absolute document numbers, ours numbers within the split.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from megatron.data.datasets.builder import parse_split
from megatron.data.datasets.cpm2_dataset import CPM2Dataset
from megatron.data.datasets.t5_dataset import IGNORE_INDEX, T5SpecialTokens

CPM2_DATA = Path(__file__).resolve().parents[1] / "data" / "cpm2"
FIXTURE = CPM2_DATA / "three_files"
PREFIX = str(FIXTURE / "zh_mix_document")
INFO = json.loads((FIXTURE / "reference.json").read_text(encoding="utf-8"))
CASES = [(c, s) for c in INFO["configs"] for s in ("train", "valid")]
# What the train windows of each configuration include, so that the comparison covers it.
COVERAGE = {"enc512_dec256": ("eod_masked", "several_documents"),
            "enc64_dec16": ("decoder_full", "eod_masked", "several_documents")}


def bpe_cn_vocab() -> dict:
    with open(CPM2_DATA / "bpe_cn" / "vocab.txt", encoding="utf-8") as f:
        return {line.strip(): i for i, line in enumerate(f)}


VOCAB = bpe_cn_vocab()
TOKENS = T5SpecialTokens(pad_id=VOCAB["<pad>"], eos_id=VOCAB["<eod>"],
                         decoder_start_token_id=VOCAB["<s>"],
                         sentinel_ids=tuple(VOCAB[f"<s_{i}>"] for i in range(190)))


@pytest.fixture(scope="module")
def reference():
    with np.load(FIXTURE / "reference.npz") as z:
        return {k: z[k] for k in z.files}


def ours(config, split, tmp_path, **kw):
    c, s = INFO["configs"][config], INFO["configs"][config]["splits"][split]
    return CPM2Dataset(PREFIX, tuple(s["documents"]), s["num_samples"], c["enc_seq_length"],
                       c["dec_seq_length"], TOKENS, seed=c["seed"], name=split,
                       cache_dir=str(tmp_path / "cache"), **kw)


def test_special_ids_are_those_cpm2_used():
    ids = INFO["special_ids"]
    assert VOCAB["<s>"] == ids["decoder_start"] == 1
    assert (TOKENS.pad_id, TOKENS.eos_id) == (ids["pad"], ids["eod"])
    assert TOKENS.sentinel_ids[0] == ids["sentinel_0"] and len(TOKENS.sentinel_ids) == \
        ids["sentinels"]
    assert len(VOCAB) == ids["vocab_size"] == 26240  # CPM-2's placeholder base


@pytest.mark.parametrize("config", list(INFO["configs"]))
def test_split_ranges_are_cpm2s(config):
    c = INFO["configs"][config]
    ranges = parse_split(c["split"], c["documents"])
    assert [list(r) for r in ranges[:2]] == [c["splits"][s]["documents"]
                                             for s in ("train", "valid")]


def test_their_data_validates_and_gives_its_placeholder_base(tmp_path):
    ds = ours("enc64_dec16", "train", tmp_path)  # placeholder_base read from the data
    assert ds.placeholder_base == len(VOCAB)
    whole = CPM2Dataset(PREFIX, (0, INFO["configs"]["enc64_dec16"]["documents"]), 1, 64, 16,
                        TOKENS, cache_dir=str(tmp_path / "cache"))
    whole.validate()


@pytest.mark.parametrize("config,split", CASES)
def test_index_maps_equal_cpm2s(config, split, reference, tmp_path):
    s = INFO["configs"][config]["splits"][split]
    ds = ours(config, split, tmp_path, placeholder_base=len(VOCAB))
    key = f"{config}/{split}/"
    assert ds.num_windows == s["windows"]
    assert len(ds) == s["num_samples"] <= s["windows"]  # theirs: len() == windows
    np.testing.assert_array_equal(ds.doc_idx + s["documents"][0], reference[key + "doc_idx"])
    np.testing.assert_array_equal(ds.sample_idx, reference[key + "sample_idx"])
    np.testing.assert_array_equal(ds.shuffle_idx, reference[key + "shuffle_idx"])


@pytest.mark.parametrize("config,split", CASES)
def test_samples_equal_cpm2s(config, split, reference, tmp_path):
    s = INFO["configs"][config]["splits"][split]
    ds = ours(config, split, tmp_path, placeholder_base=len(VOCAB),
              return_encoder_eod_mask=True)
    ref = {k[len(f"{config}/{split}/"):]: v for k, v in reference.items()
           if k.startswith(f"{config}/{split}/")}
    enc, dec = ref["contexts"].shape[1], ref["targets"].shape[1]
    np.testing.assert_array_equal(ref["enc_position_ids"], np.arange(enc))
    np.testing.assert_array_equal(ref["dec_position_ids"], np.arange(dec))
    causal = np.tril(np.ones((dec, dec), dtype=bool))
    seen = {"decoder_full": 0, "eod_masked": 0, "several_documents": 0}
    for i in range(s["windows"]):
        j = int(ds.shuffle_idx[i])
        got = ds[i] if i < len(ds) else ds.window(j)
        where = f"{config} {split} sample {i} (window {j})"
        np.testing.assert_array_equal(got["encoder_input_ids"], ref["contexts"][i], err_msg=where)
        np.testing.assert_array_equal(got["decoder_input_ids"], ref["targets"][i], err_msg=where)
        loss = ref["loss_mask"][i].astype(bool)
        want_labels = np.where(loss, ref["labels"][i].astype(np.int64), IGNORE_INDEX)
        np.testing.assert_array_equal(got["labels"], want_labels, err_msg=where)
        np.testing.assert_array_equal(got["labels"] != IGNORE_INDEX, loss, err_msg=where)
        np.testing.assert_array_equal(got["encoder_eod_mask"], ref["ctx_eod_mask"][i],
                                      err_msg=where)
        keys = got["encoder_attention_mask"].astype(bool)
        np.testing.assert_array_equal(np.broadcast_to(keys, (enc, enc)),
                                      ref["enc_attention_mask"].astype(bool), err_msg=where)
        np.testing.assert_array_equal(np.broadcast_to(keys, (dec, enc)),
                                      ref["cross_attention_mask"].astype(bool), err_msg=where)
        real = got["decoder_attention_mask"].astype(bool)
        np.testing.assert_array_equal((causal & real[None, :])[real],
                                      ref["dec_attention_mask"].astype(bool)[real],
                                      err_msg=where)
        assert not loss[~real].any(), where
        # Ids fit the vocabulary: every placeholder became a sentinel.
        assert got["encoder_input_ids"].max() < len(VOCAB), where
        assert got["decoder_input_ids"].max() < len(VOCAB), where
        seen["decoder_full"] += bool(real.all())
        seen["eod_masked"] += bool(np.any(real & ~loss))
        seen["several_documents"] += len(ds._pieces(j)) > 1
    if split == "train":
        assert all(seen[k] for k in COVERAGE[config]), seen
