"""Data made by CPM-2-Pretrain's own preprocess_data_enc_dec.py (tests/data/cpm2/three_files, see
its README) trains with our trainer: `--data-path PREFIX` names the three files, the builder
reads them with CPM2Dataset, and k steps + save + resume give the straight run's losses.

Two tokenizers give the special ids. CPM-2's own, `--tokenizer-path tests/data/cpm2/bpe_cn` (its
vocab.txt: `<pad>` 5, `<eod>` 7, `<s>` 1, `<s_0>`.. 26050..), as a CPM-2 command line names it:
the samples are then those checked against CPM-2's own reader in
tests/unit/test_cpm2_reference.py. The trainer reads it with CPM2Tokenizer, which cuts words with
jieba, a test dependency (setup.py's "test" extra): without it this case fails, it is not
skipped. And a SentencePiece model, which trains the same data with that model's pad / eos /
decoder start / sentinels (pad 0, eos 1, sentinels 4099 down to 4000 for the session's
4000-piece model, ordinary bpe_cn pieces): not CPM-2's semantics, but the same three files.
"""

import json
from pathlib import Path

import pytest

from harness import run_workers
from train_workers import run_pretrain

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
PREFIX = REPO / "tests" / "data" / "cpm2" / "three_files" / "zh_mix_document"
# bpe_cn has 26,240 ids (a multiple of 128: no padding); CPM-2's placeholders (26240 + k) never
# reach the model, every one becomes a sentinel (test_cpm2_reference checks every window).
TINY_BPE_CN = dict(vocab_size=26240, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                   num_decoder_layers=2, num_heads=4, feed_forward_proj="gated-gelu",
                   tie_word_embeddings=False, dropout_rate=0.1)


@pytest.mark.parametrize("tokenizer", ["bpe_cn", "sentencepiece"])
def test_cpm2_preprocessed_data_trains_and_resumes(tokenizer, request, tmp_path):
    vocabulary = str(REPO / "tests" / "data" / "cpm2" / "bpe_cn") if tokenizer == "bpe_cn" \
        else str(request.getfixturevalue("spm_model"))
    model = tmp_path / "tiny_bpe_cn.json"
    model.write_text(json.dumps(TINY_BPE_CN))
    ckpt = str(tmp_path / "ckpt")

    def argv(*extra):  # CPM-2 spellings where it has them
        return ["--data-path", str(PREFIX), "--split", "949,50,1", "--data-impl", "mmap",
                "--tokenizer-path", vocabulary, "--model-config", str(model),
                "--enc-seq-length", "64", "--dec-seq-length", "16", "--seed", "7",
                "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "4",
                "--lr", "3e-3", "--lr-warmup-iters", "1", "--eval-interval", "2",
                "--eval-iters", "1", "--log-interval", "1", "--num-workers", "0",
                "--data-cache-path", str(tmp_path / "cache"), *extra]

    straight, first, second = run_workers(2, run_pretrain, [
        argv(), argv("--save", ckpt, "--exit-interval", "2"), argv("--save", ckpt, "--load", ckpt),
    ], timeout=600)[0]
    assert sorted(straight["losses"]) == [1, 2, 3, 4]
    assert all(0 < loss < 20 for loss in straight["losses"].values()), straight["losses"]
    assert first["iteration"] == 2 and second["iteration"] == 4
    assert sorted(first["losses"]) == [1, 2] and sorted(second["losses"]) == [3, 4]
    for i in range(1, 5):  # the same bits after the resume
        assert (first["losses"] | second["losses"])[i] == straight["losses"][i], i
    assert first["evals"] + second["evals"] == straight["evals"]
    assert {e[1] for e in straight["evals"]} >= {"valid"}
    # nothing was written next to the fixture (the index caches went to --data-cache-path)
    assert sorted(p.name for p in PREFIX.parent.iterdir()) == sorted(
        ["README.md", "reference.json", "reference.npz"] + [
            f"zh_mix_document{s}{x}" for s in ("_context", "_target", "_target_offset")
            for x in (".bin", ".idx")])
