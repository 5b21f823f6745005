"""CPM-2's tokenizer (bpe_cn vocab.txt + jieba) against SentencePiece and CPM-2's own code, on
the same Chinese text.

    python bench/bench_cpm2_tokenizer.py [--cpm2 /path/to/CPM-2-Pretrain] [--workers 2]

1. Text: the Chinese corpora of tests/data/corpora (cmrc2018 Wikipedia + cmrc2019 stories), one
   document per encode call, in memory.
2. Single process, one thread, MB/s of UTF-8 input per CPU second (process time, so that other
   work on the machine does not count; best of 3):
   - SentencePiece: our T5Tokenizer on a unigram model that data_tools/train_tokenizer.py trains
     on the same text (26,140 pieces + 100 sentinels = bpe_cn's 26,240 ids);
   - ours: CPM2Tokenizer on tests/data/cpm2/bpe_cn/vocab.txt, a fresh tokenizer (empty caches;
     jieba's dictionary loaded before the clock starts), and one that has seen the same texts
     (every word cached: an upper bound, not a use case);
   - the word cut alone: jieba's own `jieba.Tokenizer().cut` (what CPM-2 pays) and ours
     (megatron/data/tokenizers/jieba_segmenter.py, fresh), words into a list;
   - theirs: CPM-2-Pretrain's EncDecTokenizer (src/tokenization_enc_dec.py from --cpm2, its
     print silenced), when --cpm2 is given; its ids are checked equal to ours.
3. preprocess_data.py --workers N --chunk-mb 0.25 on the same text as JSONL, with
   --tokenizer-path bpe_cn and with the SentencePiece model (steady state, as the tool reports).
Results go to bench/RESULTS.md (section cpm2_tokenizer).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import REPO, WORK, corpora_dir, machine_line, run_measured, write_section

BPE_CN = REPO / "tests" / "data" / "cpm2" / "bpe_cn"
CORPORA = ("zh_cmrc2018_wiki.jsonl", "zh_cmrc2019_stories.jsonl")


def chinese_texts():
    texts = []
    for name in CORPORA:
        with open(corpora_dir() / name, encoding="utf-8") as f:
            texts.extend(json.loads(line)["text"] for line in f)
    return texts


def spm_model() -> Path:
    prefix = WORK / "spm_zh_26140"
    if not prefix.with_suffix(".model").exists():
        WORK.mkdir(parents=True, exist_ok=True)
        run_measured([sys.executable, str(REPO / "data_tools" / "train_tokenizer.py"),
                      "--input", *[str(corpora_dir() / n) for n in CORPORA], "--output-prefix",
                      str(prefix), "--vocab-size", "26140", "--character-coverage", "0.9995"])
    return prefix.with_suffix(".model")


def best_rate(texts, nbytes, make, runs=3):
    """MB per CPU second, best of `runs`: `make()` returns the function to time (one per run)."""
    best = float("inf")
    for _ in range(runs):
        encode = make()
        start = time.process_time()
        for t in texts:
            encode(t)
        best = min(best, time.process_time() - start)
    return nbytes / 1e6 / best


def load_theirs(cpm2: Path):
    if importlib.util.find_spec("six") is None:  # imported by their module, for Python 2 checks
        stand_in = types.ModuleType("six")
        stand_in.PY2, stand_in.PY3 = False, True
        sys.modules["six"] = stand_in
    spec = importlib.util.spec_from_file_location(
        "cpm2_tokenization_enc_dec", cpm2 / "src" / "tokenization_enc_dec.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.print = lambda *args, **kwargs: None  # their tokenize() prints every token list
    return module.EncDecTokenizer(str(BPE_CN / "vocab.txt"))


def preprocess_rate(jsonl: Path, workers: int, tokenizer_flags) -> float:
    out = WORK / "cpm2_bench_out"
    cmd = [sys.executable, str(REPO / "data_tools" / "preprocess_data.py"), "--input",
           str(jsonl), "--output-prefix", str(out), *tokenizer_flags, "--workers",
           str(workers), "--append-eod", "--no-progress", "--chunk-mb", "0.25"]
    _, _, err = run_measured(cmd)
    return float(re.search(r"steady state: ([\d.]+) MB/s", err).group(1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpm2", type=Path, default=None, help="a CPM-2-Pretrain checkout")
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args()
    from megatron.data.tokenizers.cpm2_tokenizer import CPM2Tokenizer
    from megatron.data.tokenizers.tokenizer import T5Tokenizer

    texts = chinese_texts()
    nbytes = sum(len(t.encode("utf-8")) for t in texts)
    spm = T5Tokenizer(str(spm_model()))

    def fresh_ours():
        tok = CPM2Tokenizer(BPE_CN / "vocab.txt")
        tok._cut()  # jieba's dictionary: loaded once per process, not timed
        return tok

    import jieba

    warm = fresh_ours()
    jieba_tokenizer = jieba.Tokenizer()
    jieba_tokenizer.initialize()
    rates = {
        "spm": best_rate(texts, nbytes, lambda: spm.encode),
        "ours": best_rate(texts, nbytes, lambda: fresh_ours().encode),
        "ours_warm": best_rate(texts, nbytes, lambda: warm.encode),
        "jieba": best_rate(texts, nbytes, lambda: lambda t: list(jieba_tokenizer.cut(t))),
        "segmenter": best_rate(texts, nbytes, lambda: fresh_ours()._cut()),
    }
    ids_equal = None
    if args.cpm2 is not None:
        theirs = load_theirs(args.cpm2)
        rates["theirs"] = best_rate(texts, nbytes, lambda: theirs.encode)
        ids_equal = all(theirs.encode(t) == warm.encode(t) for t in texts)
    tokens = sum(len(warm.encode(t)) for t in texts)

    jsonl = WORK / "zh.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts),
                     encoding="utf-8")
    pre_ours = preprocess_rate(jsonl, args.workers, ["--tokenizer-path", str(BPE_CN)])
    pre_spm = preprocess_rate(jsonl, args.workers, ["--tokenizer-model", str(spm_model())])

    def row(name, key):
        return f"| {name} | {rates[key]:.2f} | {rates['ours'] / rates[key]:.2f}x |"

    theirs_rows = ""
    if "theirs" in rates:
        theirs_rows = row("CPM-2-Pretrain's EncDecTokenizer (print silenced)", "theirs") + "\n"
    cmd = "python bench/bench_cpm2_tokenizer.py" + \
        (" --cpm2 CPM-2-Pretrain" if args.cpm2 else "") + f" --workers {args.workers}"
    same = "" if ids_equal is None else \
        f"\nOurs and theirs give the same ids on every document: {'yes' if ids_equal else 'NO'}."
    body = f"""## CPM-2 tokenizer (bpe_cn + jieba)

Command: `{cmd}`
Machine: {machine_line()}.
Text: {len(texts)} Chinese documents of tests/data/corpora ({nbytes / 1e6:.2f} MB UTF-8, {tokens:,}
bpe_cn tokens), in memory, one encode call per document; one process, one thread, MB per CPU
second, best of 3. SentencePiece: a unigram model that data_tools/train_tokenizer.py trained on
the same text (26,140 pieces + 100 sentinels).{same}

| tokenizer | MB/s (CPU) | ours (fresh) against it |
| --- | ---: | ---: |
{row("SentencePiece (our T5Tokenizer)", "spm")}
{row("ours: CPM2Tokenizer (fresh: empty caches)", "ours")}
{row("ours, on texts it has seen (every word cached; upper bound)", "ours_warm")}
{row("word cut alone: jieba's own jieba.Tokenizer().cut", "jieba")}
{row("word cut alone: ours (jieba_segmenter, fresh)", "segmenter")}
{theirs_rows}
The word cut is most of the cost: jieba's own cut alone runs at {rates['jieba']:.2f} MB/s, which a
tokenizer calling it (as CPM-2's does) cannot pass; ours cuts the same words
{rates['segmenter'] / rates['jieba']:.2f}x faster and caches the word pieces per word.
`preprocess_data.py --workers {args.workers} --append-eod --chunk-mb 0.25` on the same text
({nbytes / 1e6:.1f} MB of text as JSONL), steady state: {pre_ours:.2f} MB/s with
`--tokenizer-path bpe_cn`, {pre_spm:.2f} MB/s with the SentencePiece model. With CPM-2's
tokenizer, tokenizing is what preprocessing spends its time on; it scales with `--workers`
(jieba's dictionary is loaded once, before the workers fork).
"""
    write_section("cpm2_tokenizer", body)
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
