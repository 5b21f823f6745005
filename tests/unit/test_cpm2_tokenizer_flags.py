"""CPM-2's tokenizer type through the flags: how the type is chosen (a folder's vocab.txt or
*.model, --tokenizer-type, --vocab-file), preprocess_data.py with it, span corruption with its
special ids, and the trainer's validation and --dry-run (bad vocabularies exit 2)."""

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from data_tools import preprocess_data
from megatron.data.tokenizers.cpm2_tokenizer import CPM2Tokenizer
from megatron.data.storage.indexed_dataset import IndexedDataset
from megatron.data.datasets.span_corruption import uncorrupt
from megatron.data.datasets.t5_dataset import (
    IGNORE_INDEX,
    T5DatasetConfig,
    T5SpanCorruptionDataset,
    T5SpecialTokens,
)
from megatron.data.tokenizers.tokenizer import T5Tokenizer, TokenizerSpec, build_tokenizer, \
    resolve_tokenizer

BPE_CN = Path(__file__).resolve().parents[1] / "data" / "cpm2" / "bpe_cn"
TINY_BPE_CN = dict(vocab_size=26240, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                   num_decoder_layers=2, num_heads=4, feed_forward_proj="gated-gelu",
                   tie_word_embeddings=False, dropout_rate=0.0)


@pytest.fixture(scope="module")
def bpe_cn(tmp_path_factory):
    """A copy of CPM-2's bpe_cn folder, as a CPM-2 user has it."""
    folder = tmp_path_factory.mktemp("cpm2") / "bpe_cn"
    shutil.copytree(BPE_CN, folder)
    return folder


@pytest.fixture(scope="module")
def zh_jsonl(tmp_path_factory, corpora_dir):
    path = tmp_path_factory.mktemp("zh") / "zh.jsonl"
    with open(corpora_dir / "zh_cmrc2019_stories.jsonl", encoding="utf-8") as src:
        path.write_text("".join(line for _, line in zip(range(40), src)), encoding="utf-8")
    return path


def preprocess(jsonl, prefix, *tokenizer_flags, workers=1):
    return preprocess_data.main(["--input", str(jsonl), "--output-prefix", str(prefix),
                                 *tokenizer_flags, "--append-eod", "--workers", str(workers),
                                 "--no-progress"])


@pytest.fixture(scope="module")
def cpm2_data(tmp_path_factory, zh_jsonl, bpe_cn):
    out = tmp_path_factory.mktemp("cpm2_data")
    assert preprocess(zh_jsonl, out / "zh", "--tokenizer-path", str(bpe_cn)) == 0
    return str(out / "zh_text_document")


def bad_vocab_folder(tmp_path, drop):
    folder = tmp_path / "bad_bpe"
    folder.mkdir()
    lines = (BPE_CN / "vocab.txt").read_text(encoding="utf-8").split("\n")
    (folder / "vocab.txt").write_text("\n".join(p for p in lines if p not in drop),
                                      encoding="utf-8")
    return folder


# -- choosing the type ------------------------------------------------------------------------

def test_a_folder_chooses_by_what_it_holds(bpe_cn, spm_model, tmp_path):
    vocab = str(bpe_cn / "vocab.txt")
    assert resolve_tokenizer(str(bpe_cn)) == TokenizerSpec("CPM2Tokenizer", vocab)
    assert resolve_tokenizer(vocab) == ("CPM2Tokenizer", vocab)
    assert resolve_tokenizer(str(spm_model)) == ("SentencePieceTokenizer", str(spm_model))
    both = tmp_path / "both"
    shutil.copytree(bpe_cn, both)
    shutil.copy(spm_model, both / "spm.model")
    with pytest.raises(ValueError, match="holds both a CPM-2 vocab.txt and SentencePiece"):
        resolve_tokenizer(str(both))
    assert resolve_tokenizer(str(both), "CPM2Tokenizer").path == str(both / "vocab.txt")
    assert resolve_tokenizer(str(both), "SentencePieceTokenizer").path == str(both / "spm.model")
    with pytest.raises(ValueError, match="--tokenizer-path .*found 0 \\*.model"):
        resolve_tokenizer(str(tmp_path), path_flag="--tokenizer-path")
    with pytest.raises(ValueError, match="CPM2Tokenizer needs the folder's vocab.txt"):
        resolve_tokenizer(str(tmp_path), "CPM2Tokenizer")


def test_vocab_file_and_type_flags(bpe_cn, spm_model, tmp_path):
    vocab = str(bpe_cn / "vocab.txt")
    assert resolve_tokenizer(None, "CPM2Tokenizer", vocab) == ("CPM2Tokenizer", vocab)
    assert resolve_tokenizer(None, None, vocab) == ("CPM2Tokenizer", vocab)
    for args, message in [((str(spm_model), None, vocab), "not both"),
                          ((None, "SentencePieceTokenizer", vocab), "CPM2Tokenizer"),
                          ((None, "CPM2Tokenizer", str(tmp_path / "none.txt")),
                           "--vocab-file .*none.txt: no such file"),
                          ((None, None, None), "--tokenizer-model is required"),
                          ((str(tmp_path / "none.model"),), "no such file"),
                          ((vocab, "BertWordPieceTokenizer"), "choose one of")]:
        with pytest.raises(ValueError, match=message):
            resolve_tokenizer(*args)
    assert isinstance(build_tokenizer(resolve_tokenizer(str(bpe_cn))), CPM2Tokenizer)
    assert isinstance(build_tokenizer(resolve_tokenizer(str(spm_model))), T5Tokenizer)


# -- preprocessing ----------------------------------------------------------------------------

def test_preprocess_with_the_bpe_cn_folder(cpm2_data, zh_jsonl, bpe_cn, tmp_path):
    tok = CPM2Tokenizer(bpe_cn / "vocab.txt")
    ds = IndexedDataset(cpm2_data)
    texts = [json.loads(line)["text"] for line in zh_jsonl.read_text("utf-8").splitlines()]
    assert ds.num_documents == len(texts) and ds.dtype == np.uint16
    for i in (0, 17, len(texts) - 1):
        assert ds[i].tolist() == tok.encode(texts[i]) + [tok.eod]  # <eod> ends a document
    # Megatron's spelling, and two workers: the same bytes.
    assert preprocess(zh_jsonl, tmp_path / "v", "--tokenizer-type", "CPM2Tokenizer",
                      "--vocab-file", str(bpe_cn / "vocab.txt"), workers=2) == 0
    for suffix in (".bin", ".idx"):
        assert Path(cpm2_data + suffix).read_bytes() == \
            (tmp_path / f"v_text_document{suffix}").read_bytes()


@pytest.mark.parametrize("drop, missing", [(["<eod>"], "missing <eod>"),
                                           (["<s_0>"], "missing the sentinels <s_0>")])
def test_preprocess_refuses_a_bad_vocabulary(zh_jsonl, tmp_path, capsys, drop, missing):
    folder = bad_vocab_folder(tmp_path, drop)
    assert preprocess(zh_jsonl, tmp_path / "out", "--tokenizer-path", str(folder)) == 2
    err = capsys.readouterr().err
    assert str(folder / "vocab.txt") in err and missing in err
    assert not list(tmp_path.glob("out*"))


def test_preprocess_without_jieba_names_it(zh_jsonl, bpe_cn, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "jieba", None)
    assert preprocess(zh_jsonl, tmp_path / "out", "--tokenizer-path", str(bpe_cn)) == 2
    assert "pip install jieba" in capsys.readouterr().err


def test_preprocess_flag_errors_exit_2(zh_jsonl, bpe_cn, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        preprocess(zh_jsonl, tmp_path / "out", "--tokenizer-path", str(tmp_path))
    assert e.value.code == 2 and "found 0" in capsys.readouterr().err


# -- span corruption with CPM-2's special ids --------------------------------------------------

def test_span_corruption_uses_cpm2_sentinels_and_pad(cpm2_data, bpe_cn):
    tok = CPM2Tokenizer(bpe_cn / "vocab.txt")
    special = T5SpecialTokens.from_tokenizer(tok)
    assert (special.pad_id, special.eos_id, special.decoder_start_token_id) == (5, 7, 1)
    assert special.sentinel_ids[:2] == (26050, 26051) and len(special.sentinel_ids) == 190
    assert T5SpecialTokens.from_tokenizer(tok, whole_word=True).word_start.all()
    indexed = IndexedDataset(cpm2_data)
    ds = T5SpanCorruptionDataset("train", indexed, (0, indexed.num_documents), 50,
                                 T5DatasetConfig(encoder_seq_length=128, seed=3), special)
    for i in range(len(ds)):
        s = ds[i]
        enc = s["encoder_input_ids"][s["encoder_attention_mask"] == 1]
        labels = s["labels"][s["labels"] != IGNORE_INDEX]
        assert s["decoder_input_ids"][0] == 1  # <s>
        assert {26050} <= set(enc.tolist()) and labels[0] == 26050 and labels[-1] == 7
        assert np.all(s["encoder_input_ids"][s["encoder_attention_mask"] == 0] == 5)
        raw = uncorrupt(enc, labels, special.sentinel_ids, tok.eod)
        assert raw.tolist() == ds.raw_tokens(i).tolist()


# -- the trainer ------------------------------------------------------------------------------

def trainer_argv(data, tokenizer_flags, model, *extra):
    return ["--data-path", data, *tokenizer_flags, "--model-config", str(model),
            "--lr", "1e-3", "--train-iters", "10", "--encoder-seq-length", "64",
            "--split", "90,5,5", "--micro-batch-size", "2", "--global-batch-size", "2",
            "--num-workers", "0", *extra]


@pytest.fixture(scope="module")
def tiny_bpe_cn(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "tiny_bpe_cn.json"
    path.write_text(json.dumps(TINY_BPE_CN))
    return path


def test_trainer_takes_the_bpe_cn_folder(cpm2_data, bpe_cn, tiny_bpe_cn, capsys, tmp_path):
    from megatron.arguments import parse_args
    from megatron.pretrain_t5 import main

    config = parse_args(trainer_argv(cpm2_data, ["--tokenizer-path", str(bpe_cn)], tiny_bpe_cn),
                        env={})
    assert config.data.tokenizer_type == "CPM2Tokenizer"
    assert config.data.tokenizer_model == str(bpe_cn / "vocab.txt")
    assert config.flags["tokenizer_type"] == "CPM2Tokenizer"
    config = parse_args(trainer_argv(cpm2_data, ["--tokenizer-type", "CPM2Tokenizer",
                                                 "--vocab-file", str(bpe_cn / "vocab.txt")],
                                     tiny_bpe_cn), env={})
    assert config.data.tokenizer == ("CPM2Tokenizer", str(bpe_cn / "vocab.txt"))
    argv = trainer_argv(cpm2_data, ["--tokenizer-path", str(bpe_cn)], tiny_bpe_cn, "--dry-run")
    assert main(argv) == 0
    assert "dry run: the flags and files are valid" in capsys.readouterr().out


def test_trainer_refuses_bad_cpm2_vocabularies(cpm2_data, bpe_cn, tiny_bpe_cn, tmp_path,
                                              capsys):
    from megatron.arguments import ArgumentsError, parse_args
    from megatron.pretrain_t5 import main

    small = tmp_path / "tiny_4100.json"
    small.write_text(json.dumps({**TINY_BPE_CN, "vocab_size": 4100}))
    with pytest.raises(ArgumentsError) as e:
        parse_args(trainer_argv(cpm2_data, ["--tokenizer-path", str(bpe_cn)], small), env={})
    assert e.value.problems == [
        f"--tokenizer-path {bpe_cn / 'vocab.txt'} (a CPM-2 vocabulary) has 26240 ids but the "
        "model's vocab_size is 4100; raise vocab_size in --model-config to at least 26240"]
    folder = bad_vocab_folder(tmp_path, ["<pad>", "<unk>"])
    assert main(trainer_argv(cpm2_data, ["--tokenizer-path", str(folder)], tiny_bpe_cn)) == 2
    err = capsys.readouterr()
    text = err.out + err.err
    assert str(folder / "vocab.txt") in text and "missing <unk>, <pad>" in text
