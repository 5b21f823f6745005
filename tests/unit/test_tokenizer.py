"""T5Tokenizer against its references (HF transformers' T5Tokenizer, SentencePiece itself) and the
train_tokenizer CLI.

The one intended difference from HF (see megatron/data/tokenizers/tokenizer.py): HF 5.x ignores the model's
byte fallback and writes one <unk> for a run of out-of-vocabulary characters, where SentencePiece
(and we) spell them as UTF-8 byte pieces; comparisons map each run of byte pieces to one <unk>.
"""

import gzip
import json
import os
import pickle
import random
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

from data_tools import tokenizer_corpus, train_tokenizer
from megatron.data.tokenizers.tokenizer import SentencePieceTokenizer, T5Tokenizer

REPO = Path(__file__).resolve().parents[2]
CORPORA = ("en_wikitext2.jsonl", "en_shakespeare.jsonl", "zh_cmrc2018_wiki.jsonl",
           "zh_cmrc2019_stories.jsonl")
# Characters surely outside a 4000-piece vocabulary: emoji, Devanagari, rare CJK, Hangul.
RARE = "🦜🧬 नमस्ते 龘靐齉 한국어"


def read_docs(path, n=None):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for k, line in enumerate(f) if n is None or k < n]


@pytest.fixture(scope="module")
def docs(corpora_dir):
    """Every document of the four corpora (2,025; English and Chinese)."""
    return [d for name in CORPORA for d in read_docs(corpora_dir / name)]


@pytest.fixture(scope="module")
def tok(spm_model):
    return T5Tokenizer(spm_model)


@pytest.fixture(scope="module")
def hf(spm_model, tmp_path_factory):
    """transformers' T5Tokenizer on the same model, loaded offline with sockets blocked."""
    folder = tmp_path_factory.mktemp("hf_t5")
    shutil.copy(spm_model, folder / "spiece.model")  # the file name HF looks for
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")

        def no_network(*args, **kwargs):
            raise AssertionError("the test tried to use the network")

        mp.setattr(socket.socket, "connect", no_network)
        from transformers import T5Tokenizer as HFT5Tokenizer

        return HFT5Tokenizer.from_pretrained(str(folder))


def as_hf_would(tok, ids):
    """`ids` with each run of byte pieces replaced by one <unk>, as HF (no byte fallback) has it."""
    out = []
    for i in ids:
        if i < tok.sp_vocab_size and tok._sp.is_byte(i):
            if out and out[-1] is None:
                continue
            i = None
        out.append(i)
    return [tok.unk_id if i is None else i for i in out]


def check_same_as_hf(tok, ours, theirs):
    """Equal, or a near-tie that SentencePiece's float32 lattice over the whole text resolved the
    other way (HF scores each word in float64): same text, scores equal up to float32 rounding.
    Returns whether it was a near-tie."""
    if ours == theirs:
        return False
    k = 0
    while k < min(len(ours), len(theirs)) and ours[k] == theirs[k]:
        k += 1
    e = 0
    while e < min(len(ours), len(theirs)) - k and ours[-1 - e] == theirs[-1 - e]:
        e += 1
    a, b = ours[k:len(ours) - e], theirs[k:len(theirs) - e]
    pieces = lambda ids: [tok.id_to_piece(i) for i in ids]  # noqa: E731
    assert tok.decode(a) == tok.decode(b) and tok.unk_id not in a + b, (
        f"token {k}: ours {pieces(a)} vs HF {pieces(b)}")
    score = lambda ids: sum(tok._sp.get_score(i) for i in ids)  # noqa: E731
    total = abs(score(ours))
    assert abs(score(a) - score(b)) <= 8 * float(np.spacing(np.float32(total))), (a, b)
    return True


def test_ids_match_hf_on_corpora(tok, hf, docs):
    """Every corpus document, English and Chinese; WikiText has many literal "<unk>"."""
    near_ties = bytes_seen = 0
    ours_all = tok.encode_batch(docs, add_eos=True)
    for text, ours in zip(docs, ours_all):
        theirs = hf(text)["input_ids"]
        mapped = as_hf_would(tok, ours)
        bytes_seen += mapped != ours
        near_ties += check_same_as_hf(tok, mapped, theirs)
    assert bytes_seen > 10  # the byte-fallback path was exercised (rare CJK characters)
    assert near_ties <= len(docs) // 100


def with_specials(text, rng, tok):
    """`text` with literal special-token strings inserted at random places, with and without
    whitespace around them, and some strings that merely look like sentinels."""
    tokens = ([f"<extra_id_{i}>" for i in (0, 1, 9, 10, 42, 99)] + ["<unk>", "</s>", "<pad>"]
              + ["<extra_id_100>", "<extra_id_01>", "<EXTRA_ID_3>", "<extra_id_>", "<extra_id_7"])
    pads = ["", " ", "  ", "\n", " \n ", "\t", "\u3000"]
    pieces = []
    for k in range(0, len(text), max(1, len(text) // 8)):
        pieces.append(text[k:k + max(1, len(text) // 8)])
        pieces.append(rng.choice(pads) + rng.choice(tokens) + rng.choice(pads))
    if rng.random() < 0.5:
        pieces.insert(0, rng.choice(tokens))
    return "".join(pieces)


@pytest.fixture(scope="module")
def special_texts(corpora_dir, tok):
    rng = random.Random(1234)
    base = [d[:3000] for name in CORPORA for d in read_docs(corpora_dir / name, 25)]
    texts = [with_specials(t, rng, tok) for t in base]
    texts += ["<extra_id_0>", " <extra_id_0> ", "<extra_id_0><extra_id_1>", "a<extra_id_0>b",
              "hello.<extra_id_0>.", "x\n<extra_id_1>\ny", "a<unk>b", "</s></s>", "<pad>",
              "中文<extra_id_5>中文", "<extra_id_99> " + RARE, "", "   ", "<", "<<extra_id_2>>"]
    return texts


def test_literal_specials_match_hf(tok, hf, special_texts):
    for text in special_texts:
        ours = as_hf_would(tok, tok.encode(text, add_eos=True))
        assert ours == hf(text)["input_ids"], repr(text)


def test_vocabulary_matches_hf(tok, hf):
    assert tok.vocab_size == len(hf) == tok.sp_vocab_size + 100 == 4100
    assert (tok.pad_id, tok.eos_id, tok.unk_id) == (hf.pad_token_id, hf.eos_token_id,
                                                    hf.unk_token_id) == (0, 1, 2)
    assert tok.decoder_start_token_id == tok.pad_id and tok.eod == tok.eod_id == tok.eos_id
    for i in range(100):
        sid = hf.convert_tokens_to_ids(f"<extra_id_{i}>")
        assert tok.sentinel_id(i) == tok.sentinel_ids[i] == sid == tok.vocab_size - 1 - i
        assert tok.piece_to_id(f"<extra_id_{i}>") == sid and tok.is_sentinel(sid)
    assert tok.additional_special_tokens_ids == tok.sentinel_ids
    all_ids = list(range(tok.vocab_size))
    assert [tok.id_to_piece(i) for i in all_ids] == hf.convert_ids_to_tokens(all_ids)
    assert tok.vocab == hf.get_vocab() and tok.inv_vocab[4099] == "<extra_id_0>"
    assert tok.piece_to_id("no such") == tok.unk_id == hf.convert_tokens_to_ids("no such")
    assert not tok.is_sentinel(tok.sp_vocab_size - 1) and not tok.is_sentinel(tok.vocab_size)
    with pytest.raises(IndexError):
        tok.sentinel_id(100)
    with pytest.raises(IndexError):
        tok.id_to_piece(tok.vocab_size)


def test_decode_matches_hf(tok, hf, docs):
    """Sequences without byte pieces (HF cannot decode those), specials sprinkled in."""
    rng = random.Random(7)
    specials = [0, 1, 2] + tok.sentinel_ids[:3] + tok.sentinel_ids[-2:]
    checked = 0
    for text in docs[::10]:
        ids = tok.encode(text[:500])
        if any(tok._sp.is_byte(i) for i in ids):
            continue
        for _ in range(6):
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip)
        assert tok.decode(ids) == hf.decode(ids)  # the same default: special tokens kept
        checked += 1
    assert checked > 50
    span = [tok.sentinel_id(0)] + tok.encode("Shall I compare thee") + [tok.sentinel_id(1),
                                                                         tok.eos_id, tok.pad_id]
    assert tok.decode(span) == hf.decode(span) == "<extra_id_0> Shall I compare thee" \
        "<extra_id_1></s><pad>"
    assert tok.decode(span, skip_special_tokens=True) == \
        hf.decode(span, skip_special_tokens=True) == "Shall I compare thee"
    assert tok.decode(np.array(ids, dtype=np.uint16)) == tok.decode(ids)
    assert tok.detokenize(ids) == tok.decode(ids)


def test_round_trip_is_normalization(tok, docs):
    """decode(encode(x)) == normalize(x): nothing is lost, out-of-vocabulary text included."""
    texts = [d.replace("<unk>", "UNK") for d in docs]  # literal specials decode without spaces
    texts += [RARE, "  lots   of\tspace\n\nand  ﬁ ligature ＡＢＣ １２３ ", "\u2581x ▁ y"]
    for text, ids in zip(texts, tok.encode_batch(texts)):
        assert tok.decode(ids) == tok.normalize(text)
    assert tok.normalize("  a \t b  ") == "a b"
    assert any(tok._sp.is_byte(i) for i in tok.encode(RARE))


def test_encode_batch_equals_encode(tok, docs, special_texts):
    texts = docs[::10] + special_texts
    single = [tok.encode(t) for t in texts]
    assert tok.tokenize(texts[0]) == single[0]
    for threads in (None, 1, 2):
        assert tok.encode_batch(texts, num_threads=threads) == single
    with_eos = tok.encode_batch(texts, add_eos=True)
    assert with_eos == [s + [tok.eos_id] for s in single]
    assert tok.encode_batch([]) == [] and tok.encode_batch(["", " "]) == [[], []]
    assert tok.encode_batch(iter(["a", "b"])) == [tok.encode("a"), tok.encode("b")]


def test_fast_path_is_sentencepiece(tok, spm_model, docs):
    sp = spm.SentencePieceProcessor(model_file=str(spm_model))
    plain = [d for d in docs[::15] if "<" not in d]
    assert [tok.encode(d) for d in plain] == sp.encode(plain)


def test_api_details(tok, spm_model):
    assert SentencePieceTokenizer is T5Tokenizer and len(tok) == tok.vocab_size
    assert tok.token_dtype is np.uint16
    big = T5Tokenizer(spm_model, extra_ids=62000)
    assert big.token_dtype is np.int32 and big.sentinel_id(0) == big.vocab_size - 1
    none = T5Tokenizer(spm_model, extra_ids=0)
    assert none.vocab_size == none.sp_vocab_size and none.sentinel_ids == []
    assert none.encode("a <extra_id_0>") == tok._sp.encode("a <extra_id_0>")
    copy = pickle.loads(pickle.dumps(tok))
    assert copy.encode("x <extra_id_3> y") == tok.encode("x <extra_id_3> y")
    with pytest.raises(TypeError):
        tok.encode(b"bytes")
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([tok.vocab_size])
    with pytest.raises(ValueError):
        T5Tokenizer(spm_model, extra_ids=-1)


def test_constructor_errors(tmp_path, corpora_dir):
    missing = tmp_path / "nope.model"
    with pytest.raises(ValueError, match="nope.model"):
        T5Tokenizer(missing)
    junk = tmp_path / "junk.model"
    junk.write_bytes(b"this is not a protobuf \xff\x00" * 10)
    with pytest.raises(ValueError, match="junk.model.*not a SentencePiece model"):
        T5Tokenizer(junk)
    # A model in SentencePiece's default layout (unk=0, bos=1, eos=2, no pad) is not T5's.
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(read_docs(corpora_dir / "en_shakespeare.jsonl", 20)),
        model_prefix=str(tmp_path / "default"), vocab_size=300, minloglevel=2)
    with pytest.raises(ValueError, match=r"pad_id=-1, eos_id=2, unk_id=0, bos_id=1"):
        T5Tokenizer(tmp_path / "default.model")


# -- data_tools/train_tokenizer.py ------------------------------------------------------------

def model_spec(path):
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(Path(path).read_bytes())
    return proto.trainer_spec


def write_jsonl(path, texts, key="text"):
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({key: t}, ensure_ascii=False) + "\n")


@pytest.fixture(scope="module")
def small_jsonl(corpora_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("train_in") / "small.jsonl"
    write_jsonl(path, read_docs(corpora_dir / "en_shakespeare.jsonl", 30)
                + read_docs(corpora_dir / "zh_cmrc2019_stories.jsonl", 40))
    return path


def test_session_model_layout(spm_model):
    sp = spm.SentencePieceProcessor(model_file=str(spm_model))
    assert (sp.pad_id(), sp.eos_id(), sp.unk_id(), sp.bos_id()) == (0, 1, 2, -1)
    assert [sp.id_to_piece(i) for i in range(3)] == ["<pad>", "</s>", "<unk>"]
    assert sp.get_piece_size() == 4000  # as requested; the 100 sentinels are not in the file
    spec = model_spec(spm_model)
    assert spec.model_type == spec.UNIGRAM and spec.byte_fallback
    vocab_lines = Path(spm_model).with_suffix(".vocab").read_text(encoding="utf-8").splitlines()
    assert len(vocab_lines) == 4000


def test_bpe_text_gzip_and_globs(tmp_path, small_jsonl, capsys):
    texts = read_docs(small_jsonl)
    (tmp_path / "a.txt").write_text("\n".join(texts[:30]), encoding="utf-8")
    with gzip.open(tmp_path / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        for t in texts[30:]:
            f.write(json.dumps({"body": t, "title": "标题 title"}, ensure_ascii=False) + "\n")
    prefix = tmp_path / "out" / "bpe"
    rc = train_tokenizer.main(["--input", str(tmp_path / "*.txt"), str(tmp_path / "b.jsonl.gz"),
                               "--json-keys", "body", "title", "--output-prefix", str(prefix),
                               "--vocab-size", "3000", "--model-type", "bpe"])
    assert rc == 0, capsys.readouterr().err
    assert "bpe.model" in capsys.readouterr().out
    spec = model_spec(f"{prefix}.model")
    assert spec.model_type == spec.BPE and spec.vocab_size == 3000 and spec.bos_id == -1
    tok = T5Tokenizer(f"{prefix}.model")
    assert (tok.pad_id, tok.eos_id, tok.unk_id, tok.vocab_size) == (0, 1, 2, 3100)
    for text in texts[::7]:
        assert tok.decode(tok.encode(text)) == tok.normalize(text)
    assert sorted(os.listdir(prefix.parent)) == ["bpe.model", "bpe.vocab"]


def test_long_lines_are_cut(tmp_path, corpora_dir, capsys):
    for line in (("word " * 3000).strip(), "汉字" * 5000, "x" * 9000):
        pieces = list(tokenizer_corpus.cut_line(line, 1000))
        assert all(0 < len(p.encode("utf-8")) <= 1000 for p in pieces)
        assert "".join(pieces).replace(" ", "") == line.replace(" ", "")
    long_doc = " ".join(read_docs(corpora_dir / "en_wikitext2.jsonl", 3)).replace("\n", " ")
    write_jsonl(tmp_path / "long.jsonl", [long_doc])
    rc = train_tokenizer.main(["--input", str(tmp_path / "long.jsonl"), "--output-prefix",
                               str(tmp_path / "m"), "--vocab-size", "600", "--no-byte-fallback",
                               "--character-coverage", "1.0"])
    assert rc == 0 and "1 over-long lines cut" in capsys.readouterr().out
    assert not model_spec(tmp_path / "m.model").byte_fallback


def test_a_leading_bom_is_removed_and_counted(tmp_path, small_jsonl, capsys):
    data = small_jsonl.read_bytes()
    (tmp_path / "bom.jsonl").write_bytes("\ufeff".encode() + data)
    (tmp_path / "bom.txt").write_bytes("\ufeff".encode() + b"First line\nSecond line\n")
    (tmp_path / "plain.txt").write_bytes(b"First line\nSecond line\n")

    def sentences(*paths):  # what SentencePiece is given (training is not bit-reproducible)
        args = train_tokenizer.get_args(["--input", *map(str, paths), "--output-prefix", "x"])
        return list(tokenizer_corpus.Corpus(list(map(str, paths)), args))

    assert sentences(tmp_path / "bom.jsonl", tmp_path / "bom.txt") == \
        sentences(small_jsonl, tmp_path / "plain.txt")
    rc = train_tokenizer.main(["--input", str(tmp_path / "bom.*"), str(small_jsonl),
                               "--output-prefix", str(tmp_path / "m"), "--vocab-size", "3000"])
    assert rc == 0
    assert "removed the UTF-8 byte order mark (BOM) that began 2 of 3 input files" in \
        capsys.readouterr().out


@pytest.mark.parametrize("case", ["no_match", "missing_file", "bad_json", "missing_key",
                                  "bad_utf8", "vocab_too_big"])
def test_errors_are_clean(tmp_path, small_jsonl, capsys, case):
    lines = small_jsonl.read_bytes().splitlines(keepends=True)
    bad = tmp_path / "bad.jsonl"
    inputs = [str(bad)]
    expect = "bad.jsonl:6:"
    if case == "no_match":
        inputs, expect = [str(tmp_path / "nothing*.jsonl")], "matches no file"
    elif case == "missing_file":
        inputs, expect = [str(small_jsonl), str(tmp_path / "gone.jsonl")], "gone.jsonl"
    elif case == "bad_json":
        bad.write_bytes(b"".join(lines[:5]) + b'{"text": "unterminated\n' + b"".join(lines[5:]))
        expect += " invalid JSON"
    elif case == "missing_key":
        bad.write_bytes(b"".join(lines[:5]) + b'{"txt": "typo"}\n' + b"".join(lines[5:]))
        expect += " missing key 'text'"
    elif case == "bad_utf8":
        bad.write_bytes(b"".join(lines[:5]) + b'{"text": "\xff\xfe"}\n')
        expect += " invalid UTF-8"
    else:
        inputs, expect = [str(small_jsonl)], "Vocabulary size too high"
    out_dir = tmp_path / "out"
    rc = train_tokenizer.main(["--input", *inputs, "--output-prefix", str(out_dir / "m"),
                               "--vocab-size", "100000" if case == "vocab_too_big" else "500"])
    err = capsys.readouterr().err
    assert rc == (1 if case == "vocab_too_big" else 2)
    assert expect in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not out_dir.exists() or os.listdir(out_dir) == []


def test_skip_bad_lines(tmp_path, small_jsonl, capsys):
    lines = small_jsonl.read_bytes().splitlines(keepends=True)
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"".join(lines[:5]) + b"not json\n\n" + b"".join(lines[5:]) + b"[1]\n")
    rc = train_tokenizer.main(["--input", str(bad), "--output-prefix", str(tmp_path / "m"),
                               "--vocab-size", "3000", "--skip-bad-lines"])
    out = capsys.readouterr().out
    assert rc == 0 and "skipped 2 malformed line(s)" in out and "bad.jsonl:6:" in out
    assert (tmp_path / "m.model").is_file()


@pytest.mark.parametrize("how", ["script", "module"])
def test_runs_as_script_and_module(tmp_path, small_jsonl, how):
    launcher = ([str(REPO / "data_tools" / "train_tokenizer.py")] if how == "script"
                else ["-m", "data_tools.train_tokenizer"])
    proc = subprocess.run([sys.executable, *launcher, "--input", str(small_jsonl),
                           "--output-prefix", str(tmp_path / "m"), "--vocab-size", "500",
                           "--max-docs", "20"],
                          cwd=tmp_path if how == "script" else REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "20 documents" in proc.stdout
    assert T5Tokenizer(tmp_path / "m.model").sp_vocab_size == 500
