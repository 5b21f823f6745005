"""Write reference_ids.json: the ids (and decoded text) that CPM-2-Pretrain's own tokenizer gives.

    python tests/data/cpm2/make_reference_ids.py --cpm2 /path/to/CPM-2-Pretrain

runs CPM-2-Pretrain's `EncDecTokenizer` (`src/tokenization_enc_dec.py`, imported from the
checkout given; its `tokenize` prints every token list, which is silenced here) with jieba on:

* the texts in TEXTS below (written for this fixture: edge cases, full-width characters, spaces
  and newlines, characters outside the vocabulary, English, digits);
* documents of the repository's corpora (tests/data/corpora), stored by corpus and index only;
* every document of one Chinese corpus, stored as a short digest per document (DIGESTS).

`megatron/data/tokenizers/cpm2_tokenizer.py` is tested against this file (tests/unit/test_cpm2_tokenizer.py)
without any CPM-2 code. Their tokenizer needs `six` only for Python 2 checks: a stand-in is used
when it is not installed. For bpe_cn_en, whose `▂` is id 11 while their code hard-codes id 10 (a
comma there), their tokenizer reads a copy of the vocabulary with lines 11 and 12 swapped and the
ids are swapped back; it is given max_sentinels=185, the sentinels that vocabulary has.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import sys
import tempfile
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
OUTPUT = HERE / "reference_ids.json"

TEXTS = [
    "",
    " ",
    "\n",
    "  \n \n",
    "\r\n",
    "\t",
    "好",
    "a",
    "。",
    "你好",
    "hello world",
    "hello  world",
    " leading and trailing ",
    "hello \nworld",
    "第一行\n第二行\n\n第四行",
    "我们在2021年用Python写了一个tokenizer，速度是3.5倍。",
    "CPM-2 是一个 110 亿参数的中文预训练模型 (encoder-decoder)。",
    "ＣＰＭ－２模型有１１０亿参数，训练了３００，０００步！",
    "你好，世界！（测试）？是的；如下：、。",
    "＂引号＂　全角空格～［方括号］＠＃％＆＊＋＝｜＼／＜＞",
    "ＡＢＣａｂｃ　１２３",
    "\uff00\u3000\uff5e\uff5f",
    "龘靐齉爩 鬱鬱蔥蔥 臺灣 學習",
    "表情😀🎉👍不在词表里",
    "扩展字符𠀀𪚥和\u3400\u9fa6\u9fe0",
    "こんにちは 안녕하세요 Привет",
    "café naïve e\u0301",
    "▂字面的▂和▃",
    "<eod><s_0><pad>文本</s><unk>",
    "a" * 200,
    "a" * 201,
    "测" * 250,
    "http://www.example.com/path?q=1&r=2#frag",
    "The quick brown fox jumps over the lazy dog. It's 9:30am, isn't it?",
    "3.14159 1,000,000 2021-11-24 50% #1 C++ a_b x.y.z",
    "tab\there\u00a0nbsp\u2028line",
    "他说：“这是真的吗？”她回答：‘当然。’……——《红楼梦》",
    "北京大学的学生在清华大学旁边的五道口吃饭，花了128.5元。",
    "深度学习(deep learning)是机器学习的分支，Transformer模型在2017年提出。\n"
    "GPT-3 有 175B 参数；T5 用了 span corruption。",
]

# (corpus, document indices): a spread of each corpus.
DOCUMENTS = {
    "bpe_cn": [("zh_cmrc2018_wiki.jsonl", range(0, 1104, 60)),
               ("zh_cmrc2019_stories.jsonl", range(3, 439, 40)),
               ("en_shakespeare.jsonl", (0, 181))],
    "bpe_cn_en": [("zh_cmrc2018_wiki.jsonl", range(7, 1104, 250)),
                  ("zh_cmrc2019_stories.jsonl", range(11, 439, 150)),
                  ("en_shakespeare.jsonl", (1,))],
}
DIGESTS = {"bpe_cn": ["zh_cmrc2019_stories.jsonl"]}
MAX_SENTINELS = {"bpe_cn": 190, "bpe_cn_en": 185}


def ids_digest(ids) -> str:
    """What the test recomputes: the first 16 hex digits of sha256 over the ids as text."""
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:16]


def load_theirs(cpm2: Path):
    if importlib.util.find_spec("six") is None:  # imported by their module, for Python 2 checks
        six = types.ModuleType("six")
        six.PY2, six.PY3 = False, True
        sys.modules["six"] = six
    path = cpm2 / "src" / "tokenization_enc_dec.py"
    spec = importlib.util.spec_from_file_location("cpm2_tokenization_enc_dec", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.print = lambda *args, **kwargs: None  # their tokenize() prints every token list
    return module, hashlib.sha256(path.read_bytes()).hexdigest()


class Theirs:
    """Their EncDecTokenizer on one vocabulary (see the module doc for bpe_cn_en)."""

    def __init__(self, module, vocab: Path, max_sentinels: int):
        lines = vocab.read_text(encoding="utf-8").split("\n")
        self.swap = lines[10].strip() != "\u2582"
        if self.swap:
            assert lines[11].strip() == "\u2582", "the space piece is neither id 10 nor 11"
            lines[10], lines[11] = lines[11], lines[10]
            fd, tmp = tempfile.mkstemp(suffix=".txt")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write("\n".join(lines))
            vocab_path = tmp
        else:
            vocab_path = str(vocab)
        self.module = module
        self.tok = module.EncDecTokenizer(vocab_path, max_sentinels=max_sentinels)
        if self.swap:
            os.unlink(vocab_path)

    def _map(self, ids):
        return [{10: 11, 11: 10}.get(i, i) for i in ids] if self.swap else list(ids)

    def encode(self, text):
        try:
            return self._map(self.tok.encode(text)), None
        except Exception as e:  # noqa: BLE001 - recorded as what their code does
            return None, type(e).__name__

    def decode(self, ids):
        try:
            return self.tok.decode(self._map(ids)), None
        except Exception as e:  # noqa: BLE001
            return None, type(e).__name__

    def one_token(self, text):
        """Whether their token list before the space filter has one token (then their encode
        returns it twice)."""
        half = "".join(self.module.Q2B(ch) for ch in text)
        return len(self.tok.tokenize(half)) == 1


def corpus_documents(corpora: Path, name: str):
    with open(corpora / name, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpm2", required=True, type=Path, help="a CPM-2-Pretrain checkout")
    p.add_argument("--corpora", type=Path, default=REPO / "tests" / "data" / "corpora")
    p.add_argument("--output", type=Path, default=OUTPUT)
    args = p.parse_args(argv)
    import jieba

    module, source_sha = load_theirs(args.cpm2)
    out = {"about": "ids and decoded text of CPM-2-Pretrain's EncDecTokenizer; written by "
                    "tests/data/cpm2/make_reference_ids.py (see its doc)",
           "command": "python tests/data/cpm2/make_reference_ids.py --cpm2 CPM-2-Pretrain",
           "tokenization_enc_dec.py sha256": source_sha, "jieba": jieba.__version__,
           "vocabularies": {}, "cases": [], "digests": []}
    for name, max_sentinels in MAX_SENTINELS.items():
        vocab = args.cpm2 / name / "vocab.txt"
        ours = HERE / name / "vocab.txt"
        if vocab.read_bytes() != ours.read_bytes():
            sys.exit(f"{vocab} differs from {ours}")
        theirs = Theirs(module, vocab, max_sentinels)
        out["vocabularies"][name] = {
            "sha256": hashlib.sha256(vocab.read_bytes()).hexdigest(),
            "max_sentinels": max_sentinels, "space_id_swapped_10_11": theirs.swap}
        texts = [({"text": t}, t) for t in TEXTS]
        for corpus, indices in DOCUMENTS[name]:
            docs = corpus_documents(args.corpora, corpus)
            texts += [({"corpus": corpus, "document": i}, docs[i]) for i in indices]
        for where, text in texts:
            ids, error = theirs.encode(text)
            case = {"vocab": name, **where, "ids": ids}
            if error is not None:
                case["error"] = error
            else:
                case["decoded"], decode_error = theirs.decode(ids)
                if decode_error is not None:
                    case["decode_error"] = decode_error
                if theirs.one_token(text):
                    case["one_token"] = True
            out["cases"].append(case)
        for corpus in DIGESTS.get(name, []):
            docs = corpus_documents(args.corpora, corpus)
            digests = [ids_digest(theirs.encode(d)[0]) for d in docs]
            out["digests"].append({"vocab": name, "corpus": corpus, "documents": digests})
    with open(args.output, "w", encoding="utf-8") as f:
        f.write("{\n")
        head = [k for k in out if k not in ("cases", "digests")]
        for k in head:
            f.write(f" {json.dumps(k)}: {json.dumps(out[k], ensure_ascii=False)},\n")
        for k in ("cases", "digests"):
            f.write(f' {json.dumps(k)}: [\n')
            rows = [json.dumps(c, ensure_ascii=False) for c in out[k]]
            f.write(",\n".join("  " + r for r in rows))
            f.write("\n ]" + (",\n" if k == "cases" else "\n"))
        f.write("}\n")
    print(f"wrote {args.output}: {len(out['cases'])} cases, "
          f"{sum(len(d['documents']) for d in out['digests'])} digested documents")
    return 0


if __name__ == "__main__":
    sys.exit(main())
