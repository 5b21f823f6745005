"""CPM-2's vocab.txt tokenizer (megatron/data/tokenizers/cpm2_tokenizer.py) against the ids and decoded text
that CPM-2-Pretrain's own EncDecTokenizer gave (tests/data/cpm2/reference_ids.json, written by
tests/data/cpm2/make_reference_ids.py; no CPM-2 code runs here), plus the cases where we chose
to differ from it and the errors."""

import hashlib
import json
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron.data.tokenizers.cpm2_tokenizer import CPM2Tokenizer, CPM2VocabularyError, load_vocabulary

CPM2_DATA = Path(__file__).resolve().parents[1] / "data" / "cpm2"
BPE_CN = CPM2_DATA / "bpe_cn" / "vocab.txt"
BPE_CN_EN = CPM2_DATA / "bpe_cn_en" / "vocab.txt"


@pytest.fixture(scope="module")
def reference():
    return json.loads((CPM2_DATA / "reference_ids.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def tokenizers():
    return {"bpe_cn": CPM2Tokenizer(BPE_CN), "bpe_cn_en": CPM2Tokenizer(BPE_CN_EN)}


@pytest.fixture(scope="module")
def documents(corpora_dir):
    cache = {}

    def get(corpus, index):
        if corpus not in cache:
            with open(corpora_dir / corpus, encoding="utf-8") as f:
                cache[corpus] = [json.loads(line)["text"] for line in f]
        return cache[corpus][index]
    return get


def case_text(case, documents):
    return case["text"] if "text" in case else documents(case["corpus"], case["document"])


def expected_ids(case):
    """Theirs, except where the module doc says we differ: [] where theirs raises (empty
    text), one id where theirs repeats a text's only token."""
    if "error" in case:
        return []
    return case["ids"][:1] if case.get("one_token") else case["ids"]


def describe(case):
    where = repr(case["text"][:40]) if "text" in case else f"{case['corpus']}#{case['document']}"
    return f"{case['vocab']} {where}"


def test_reference_file_is_for_these_vocabularies(reference):
    for name, path in (("bpe_cn", BPE_CN), ("bpe_cn_en", BPE_CN_EN)):
        assert reference["vocabularies"][name]["sha256"] == \
            hashlib.sha256(path.read_bytes()).hexdigest()
    assert len(reference["cases"]) > 100


def test_ids_equal_cpm2s(reference, tokenizers, documents):
    wrong = []
    for case in reference["cases"]:
        got = tokenizers[case["vocab"]].encode(case_text(case, documents))
        if got != expected_ids(case):
            wrong.append(f"{describe(case)}: {got[:12]} != {expected_ids(case)[:12]}")
    assert not wrong, "\n".join(wrong[:10])


def test_decode_equals_cpm2s(reference, tokenizers, documents):
    wrong = []
    for case in reference["cases"]:
        if "error" in case:
            continue
        tok = tokenizers[case["vocab"]]
        if tok.decode(case["ids"]) != case["decoded"]:  # their decode of their ids
            wrong.append(f"{describe(case)}: decode of their ids")
        if not case.get("one_token") and \
                tok.decode(tok.encode(case_text(case, documents))) != case["decoded"]:
            wrong.append(f"{describe(case)}: decode(encode(text))")
    assert not wrong, "\n".join(wrong[:10])


def test_whole_corpus_ids_equal_cpm2s(reference, tokenizers, documents):
    """Every document of a Chinese corpus, as per-document digests of their ids."""
    for entry in reference["digests"]:
        tok = tokenizers[entry["vocab"]]
        wrong = []
        for i, digest in enumerate(entry["documents"]):
            ids = tok.encode(documents(entry["corpus"], i))
            if hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:16] != digest:
                wrong.append(i)
        assert not wrong, f"{entry['corpus']}: documents {wrong[:10]} differ from CPM-2's"
        assert len(entry["documents"]) > 400


def test_segmenter_gives_jiebas_words(reference, tokenizers, documents):
    """megatron.data.tokenizers.jieba_segmenter against jieba.cut itself (a fresh jieba.Tokenizer)."""
    import jieba

    jieba_cut = jieba.Tokenizer().cut
    ours = tokenizers["bpe_cn"]._cut()
    texts = [case_text(c, documents) for c in reference["cases"]]
    texts += [documents("zh_cmrc2018_wiki.jsonl", i) for i in range(1, 1104, 9)]
    texts += [documents("en_wikitext2.jsonl", 0)[:20000], "１２３４５６７８９０" * 30,
              "王小明和李华在３．１４％的概率下去了乌鲁木齐。" * 3, "\r\n\r\n \u3000\t"]
    wrong = [t[:40] for t in texts if ours(t) != list(jieba_cut(t))]
    assert not wrong, wrong[:5]


def test_special_ids(tokenizers):
    cn, en = tokenizers["bpe_cn"], tokenizers["bpe_cn_en"]
    assert len(cn) == cn.vocab_size == 26240 and len(en) == 51968
    assert (cn.unk_id, cn.decoder_start_token_id, cn.pad, cn.eod) == (0, 1, 5, 7)
    assert cn.eod == cn.eod_id == cn.eos == cn.eos_id
    assert cn.sentinel_ids == list(range(26050, 26240)) == cn.additional_special_tokens_ids
    assert cn.sentinel_id(0) == 26050 and cn.sentinel_id(189) == 26239
    with pytest.raises(IndexError):
        cn.sentinel_id(190)
    assert cn.is_sentinel(26050) and not cn.is_sentinel(26049)
    assert (en.eod, en.pad, en.decoder_start_token_id, len(en.sentinel_ids)) == (8, 5, 1, 185)
    assert en.sentinel_ids[0] == 51783
    assert cn.token_dtype is np.uint16 and en.token_dtype is np.uint16
    assert cn.id_to_piece(26050) == "<s_0>" and cn.piece_to_id("<s_0>") == 26050
    assert cn.piece_to_id("no such piece") == cn.unk_id
    assert cn.vocab["<eod>"] == 7 and cn.inv_vocab[7] == "<eod>" and len(cn.vocab) == 26240
    with pytest.raises(IndexError):
        cn.id_to_piece(26240)
    assert {cn.unk_id, cn.pad_id, cn.eod, 1, 2, 26050, 26239} <= cn.special_ids
    assert cn.piece_to_id("<") not in cn.special_ids


def test_edge_cases(tokenizers):
    cn = tokenizers["bpe_cn"]
    space, newline = cn.piece_to_id("\u2582"), cn.piece_to_id("\u2583")
    assert cn.encode("") == [] and cn.decode([]) == ""
    assert cn.encode(" ") == [space] and cn.encode("\n") == [newline]  # theirs: twice
    assert cn.encode("   ") == [space] * 3 and cn.encode("\n\n") == [newline] * 2
    assert cn.encode("好") == [cn.piece_to_id("好")]
    assert cn.encode("\u3000") == [space]  # the ideographic space is a space
    # Words over 200 characters are one <unk>; 200 are cut into pieces.
    assert cn.encode("a" * 201) == [cn.unk_id]
    assert len(cn.encode("a" * 200)) > 1
    assert cn.encode("a" * 201 + " 好") == [cn.unk_id, space, cn.piece_to_id("好")]
    # Characters outside the vocabulary.
    assert cn.encode("😀") == [cn.unk_id] and cn.decode(cn.encode("好😀")) == "好<unk>"
    # Full width: letters and digits become ASCII, the kept punctuation stays.
    assert cn.normalize("ＡＢＣ１２３　，。！（）？、；：．") == "ABC123 ，。！（）？、；：."
    assert cn.encode("Ａ") == cn.encode("A")
    kept = "，！（）？；："
    assert [cn.id_to_piece(i) for i in cn.encode(kept)] == list(kept)
    # English words lose the space between them; decode puts it back.
    hello = cn.encode("hello world")
    assert space not in hello and cn.decode(hello) == "hello world"
    assert space in cn.encode("你好 world")
    # Literal special strings are text, as in CPM-2.
    assert cn.sentinel_id(0) not in cn.encode("<s_0>") and cn.eod not in cn.encode("<eod>")
    assert cn.encode("你好", add_eos=True)[-1] == cn.eod


def test_bpe_cn_en_uses_its_own_space_id(tokenizers):
    """Their code hard-codes id 10 (a comma in bpe_cn_en): we keep commas, drop spaces."""
    en = tokenizers["bpe_cn_en"]
    ids = en.encode("hello,world and tokenization")
    assert [en.id_to_piece(i) for i in ids] == ["hello", ",", "world", "and", "token",
                                                 "##ization"]
    assert en.decode(ids) == "hello , world and token ##ization"  # CPM-2's decode keeps ##
    assert en.word_start_mask()[en.piece_to_id("##ization")] == False  # noqa: E712
    assert en.word_start_mask()[en.piece_to_id("token")]
    assert tokenizers["bpe_cn"].word_start_mask().all()


def test_decode_options_and_errors(tokenizers):
    cn = tokenizers["bpe_cn"]
    ids = [cn.sentinel_id(0)] + cn.encode("你好") + [cn.eod, cn.pad]
    assert cn.decode(ids) == "<s_0>你好<eod> <pad>"
    assert cn.decode(ids, skip_special_tokens=True) == "你好"
    assert cn.decode(np.array(ids, dtype=np.uint16)) == cn.detokenize(ids)
    with pytest.raises(ValueError, match="out of range"):
        cn.decode([26240])
    with pytest.raises(TypeError):
        cn.encode(b"bytes")


def test_batch_cache_and_pickle(tokenizers, documents):
    cn = tokenizers["bpe_cn"]
    texts = [documents("zh_cmrc2018_wiki.jsonl", i) for i in range(5)] + ["", " a b "]
    once = [cn.encode(t) for t in texts]
    assert cn.encode_batch(texts) == once == [cn.tokenize(t) for t in texts]
    assert cn.encode_batch(texts, add_eos=True) == [ids + [cn.eod] for ids in once]
    copy = pickle.loads(pickle.dumps(cn))
    assert copy._jieba is None and copy.encode_batch(texts) == once


def write_vocab(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


GOOD = ["<unk>", "<s>", "</s>", "\u2583", "<sep>", "<pad>", "<mask>", "<eod>", "\u2581", ",",
        "\u2582", "的", "好", "a", "b"] + [f"<s_{i}>" for i in range(4)]


@pytest.mark.parametrize("drop, message", [
    (["<eod>"], "missing <eod>"),
    (["<pad>", "<unk>"], "missing <unk>, <pad>"),
    ([f"<s_{i}>" for i in range(4)], "missing the sentinels <s_0>, <s_1>, ..."),
    (["<s_0>"], "missing the sentinels"),
    (["<s_2>"], "missing <s_2> (the sentinels must run from <s_0> without a gap; <s_3>"),
])
def test_bad_vocabulary_names_file_and_what_is_missing(tmp_path, drop, message):
    path = write_vocab(tmp_path / "vocab.txt", [p for p in GOOD if p not in drop])
    with pytest.raises(CPM2VocabularyError) as e:
        CPM2Tokenizer(path)
    assert str(path) in str(e.value) and message in str(e.value)


def test_other_bad_vocabularies(tmp_path):
    small = CPM2Tokenizer(write_vocab(tmp_path / "vocab.txt", GOOD))
    assert small.vocab_size == len(GOOD) and len(small.sentinel_ids) == 4
    assert small.encode("好 a b") == [12, 10, 13, 14] and small.encode("x") == [0]
    with pytest.raises(CPM2VocabularyError, match="line 20 repeats line 13"):
        load_vocabulary(str(write_vocab(tmp_path / "dup.txt", GOOD + ["好"])))
    (tmp_path / "latin1.txt").write_bytes("\n".join(GOOD).encode() + b"\ncaf\xe9\n")
    with pytest.raises(CPM2VocabularyError, match="not a UTF-8 text file"):
        CPM2Tokenizer(tmp_path / "latin1.txt")
    with pytest.raises(CPM2VocabularyError, match="no such CPM-2 vocabulary file"):
        CPM2Tokenizer(tmp_path / "absent.txt")


def test_missing_jieba_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "jieba", None)  # import jieba now raises ImportError
    with pytest.raises(ImportError, match="pip install jieba"):
        CPM2Tokenizer(BPE_CN)
