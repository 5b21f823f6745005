"""Train a SentencePiece model in T5's layout from JSONL or plain-text corpora.

    python data_tools/train_tokenizer.py --input corpus/*.jsonl.gz --output-prefix spm/t5 \\
        --vocab-size 32000

writes `spm/t5.model` and `spm/t5.vocab`: pad=0, eos=1, unk=2, no bos, as T5's `spiece.model`.
`megatron.data.tokenizers.tokenizer.T5Tokenizer` adds the 100 `<extra_id_N>` sentinels on top, so the model's
full vocabulary is `--vocab-size` + 100. Also runs as `python -m data_tools.train_tokenizer`.
`--ul2-mode-tokens` adds UL2's mode tokens `[NLU]`, `[NLG]`, `[S2S]` as user-defined symbols
(ids 3, 4, 5 of the `--vocab-size`): one id each for `--t5-objective ul2`, where a tokenizer
without them spells each in several pieces, all starting with the same ones.

Input: `.jsonl`/`.json` (optionally `.gz`): one JSON object per line, the text under `--json-keys`;
`.txt` (optionally `.gz`): one sentence per line. Files and globs may be mixed. Input is streamed
to the trainer (SentencePiece samples at most `--input-sentence-size` sentences from it), never
loaded whole. Documents are cut into lines, and lines longer than `--max-sentence-length` bytes are
cut at a space or CJK full stop, so that SentencePiece drops nothing for being too long.

Bad input: a pattern matching no file, an unreadable file or a malformed line (invalid UTF-8 or
JSON, not an object, a missing key, a non-string value) stops the run with one message naming file
and line, before anything is written. A malformed line usually means a wrong file or a wrong
`--json-keys`, which would silently leave little or nothing to train on, hence the default;
`--skip-bad-lines` skips such lines instead and reports their count. Empty documents and blank
lines are not errors; they are just not used.

Outputs appear under their names only when complete (written to temporary names, checked by
loading them, then renamed); a failed or interrupted run leaves none.
Exit status: 0 done, 2 bad arguments or input, 1 SentencePiece failed (e.g. a vocabulary larger
than the corpus allows; its message says the largest possible size).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Optional, Sequence

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sentencepiece as spm

from data_tools.extend_tokenizer import extend
from data_tools.tokenizer_corpus import Corpus, InputError, check_readable, remove
from megatron.cli import CommandLineParser
from megatron.data.storage.paths import path_flag_problems
from megatron.data.datasets.ul2 import DEFAULT_MODE_TOKENS
from megatron.data.preprocess.jsonl import expand_inputs
from megatron.data.tokenizers.tokenizer import T5Tokenizer, available_cpus

# UL2's mode tokens (megatron/data/datasets/ul2.py's defaults), as SentencePiece user-defined symbols.
UL2_MODE_TOKENS = tuple(DEFAULT_MODE_TOKENS[kind] for kind in "RXS")  # [NLU], [NLG], [S2S]


def get_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = CommandLineParser(
        description="Train a SentencePiece tokenizer in T5's layout (pad=0, eos=1, unk=2, no bos).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--input", nargs="+", required=True,
                   help="files or globs: .jsonl/.json[.gz] (JSON lines) or .txt[.gz] (one sentence "
                        "per line)")
    p.add_argument("--input-format", choices=("auto", "jsonl", "text"), default="auto",
                   help="how to read the inputs; auto decides by file name suffix")
    p.add_argument("--json-keys", nargs="+", default=["text"],
                   help="JSON keys whose texts are used (all of them)")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    p.add_argument("--vocab-size", type=int, default=32000,
                   help="SentencePiece vocabulary (T5's 100 sentinels come on top)")
    p.add_argument("--model-type", choices=("unigram", "bpe"), default="unigram")
    p.add_argument("--character-coverage", type=float, default=0.9995,
                   help="share of characters covered by the vocabulary; 0.9995 suits Chinese/"
                        "Japanese, use 1.0 for English or other small alphabets")
    p.add_argument("--byte-fallback", action=argparse.BooleanOptionalAction, default=True,
                   help="spell out-of-vocabulary characters as UTF-8 byte pieces instead of <unk>")
    p.add_argument("--input-sentence-size", type=int, default=2_000_000,
                   help="SentencePiece samples at most this many lines (0: all)")
    p.add_argument("--max-sentence-length", type=int, default=4192,
                   help="longest line in bytes given to SentencePiece; longer lines are cut")
    p.add_argument("--max-docs", type=int, default=0,
                   help="stop after this many documents (JSON objects or text lines; 0: all)")
    p.add_argument("--num-threads", type=int, default=available_cpus(),
                   help="SentencePiece trainer threads")
    p.add_argument("--seed", type=int, default=1234, help="seed of SentencePiece's sampling")
    p.add_argument("--split-digits", action="store_true", help="make every digit its own piece")
    p.add_argument("--normalization-rule-name", default="nmt_nfkc",
                   choices=("nmt_nfkc", "nfkc", "nmt_nfkc_cf", "nfkc_cf", "identity"))
    p.add_argument("--ul2-mode-tokens", action="store_true",
                   help=f"add UL2's mode tokens {', '.join(UL2_MODE_TOKENS)} as user-defined "
                        "symbols: one id each (else each is tokenized into several pieces)")
    p.add_argument("--skip-bad-lines", action="store_true",
                   help="skip malformed lines (counted) instead of stopping at the first one")
    p.add_argument("--verbose", action="store_true", help="show SentencePiece's own log")
    extend = p.add_argument_group(
        "vocabulary extension", "CPM-2's bilingual stage (data_tools/extend_tokenizer.py): an old "
        "vocabulary with new pieces after it, ids unchanged; then convert_checkpoint.py "
        "--extend-vocab grows a checkpoint to it")
    extend.add_argument("--extend", metavar="OLD", default=None,
                        help="the vocabulary to extend: a SentencePiece .model (writes "
                             "PREFIX.model/.vocab; its model type and normalization are used, "
                             "--vocab-size and --model-type are not) or CPM-2's vocab.txt or its "
                             "folder (writes PREFIX/vocab.txt)")
    extend.add_argument("--add-pieces", type=int, default=None, metavar="N",
                        help="with --extend: train N pieces on --input and add those not in OLD")
    args = p.parse_args(argv)
    problems = []
    if args.vocab_size < 4 + (256 if args.byte_fallback else 0) + 3 * args.ul2_mode_tokens:
        problems.append(f"--vocab-size {args.vocab_size} is too small for 3 special pieces"
                        + (" and 256 byte pieces" if args.byte_fallback else "")
                        + (" and 3 UL2 mode tokens" if args.ul2_mode_tokens else ""))
    if not 0.0 < args.character_coverage <= 1.0:
        problems.append("--character-coverage must be in (0, 1]")
    if args.max_sentence_length < 16:
        problems.append("--max-sentence-length must be at least 16")
    for name in ("input_sentence_size", "max_docs"):
        if getattr(args, name) < 0:
            problems.append(f"--{name.replace('_', '-')} must not be negative")
    if args.num_threads < 1:
        problems.append("--num-threads must be at least 1")
    problems += path_flag_problems(vars(args), {"input": ("--input", ()), "output_prefix": (
        "--output-prefix", ()), "extend": ("--extend", ())})
    if (args.extend is None) != (args.add_pieces is None):
        problems.append("--extend OLD and --add-pieces N go together")
    elif args.extend is not None:
        if args.add_pieces < 1:
            problems.append("--add-pieces must be at least 1")
        if args.ul2_mode_tokens:
            problems.append("--ul2-mode-tokens does not apply with --extend (the old model has "
                            "its symbols)")
    if problems:
        p.error("; ".join(problems))
    return args


def train(args: argparse.Namespace) -> int:
    """Train and write the model; returns the exit code."""
    start = time.perf_counter()
    try:
        paths = expand_inputs(args.input)
        corpus = Corpus(paths, args)
        for path in paths:
            check_readable(path)
    except (FileNotFoundError, InputError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    prefix = os.path.abspath(args.output_prefix)
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    tmp = f"{prefix}.tmp-{os.getpid()}"
    temporaries = [tmp + ".model", tmp + ".vocab"]
    spm.set_random_generator_seed(args.seed)
    try:
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(corpus), model_prefix=tmp, model_type=args.model_type,
                vocab_size=args.vocab_size, character_coverage=args.character_coverage,
                byte_fallback=args.byte_fallback, input_sentence_size=args.input_sentence_size,
                shuffle_input_sentence=True, max_sentence_length=args.max_sentence_length,
                num_threads=args.num_threads, split_digits=args.split_digits,
                normalization_rule_name=args.normalization_rule_name,
                # T5's special ids; no bos, as in Google's spiece.model.
                pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
                pad_piece="<pad>", eos_piece="</s>", unk_piece="<unk>",
                user_defined_symbols=list(UL2_MODE_TOKENS) if args.ul2_mode_tokens else [],
                minloglevel=0 if args.verbose else 2)
        except (RuntimeError, InputError) as e:
            # An exception in the iterator comes back either as itself or, wrapped by
            # SentencePiece, as a RuntimeError; `corpus.error` has it either way.
            if corpus.error is not None:
                print(f"error: {corpus.error}", file=sys.stderr)
                return 2
            if corpus.sentences == 0:
                print(f"error: no text to train on in {len(paths)} file(s) "
                      f"({corpus.docs} documents, {corpus.bad} bad lines)", file=sys.stderr)
            else:
                msg = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
                msg = msg.rsplit("] ", 1)[-1]  # drop SentencePiece's source location
                print(f"error: SentencePiece training failed: {msg}", file=sys.stderr)
            return 1
        # Check what was written the way every user will load it, before it gets its name.
        tok = T5Tokenizer(tmp + ".model")
        if (tok.pad_id, tok.eos_id, tok.unk_id, tok.bos_id) != (0, 1, 2, -1):
            print(f"error: unexpected special ids in the trained model: {tok!r}", file=sys.stderr)
            return 1
        modes = [(t, tok.piece_to_id(t)) for t in UL2_MODE_TOKENS] if args.ul2_mode_tokens else []
        if any(tid == tok.unk_id for _, tid in modes):
            print(f"error: the trained model lacks a UL2 mode token: {modes}", file=sys.stderr)
            return 1
        # .vocab first: whoever sees PREFIX.model complete also finds its .vocab.
        os.replace(tmp + ".vocab", prefix + ".vocab")
        os.replace(tmp + ".model", prefix + ".model")
    finally:
        remove(temporaries)
    elapsed = time.perf_counter() - start
    print(f"inputs: {len(paths)} file(s), {corpus.docs} documents, {corpus.sentences} lines given "
          f"to SentencePiece ({corpus.cut} over-long lines cut; it samples at most "
          f"{args.input_sentence_size or 'all'})")
    if corpus.boms:
        print(f"removed the UTF-8 byte order mark (BOM) that began {corpus.boms} of "
              f"{len(paths)} input files")
    if corpus.bad:
        print(f"skipped {corpus.bad} malformed line(s), e.g.:")
        for example in corpus.bad_examples:
            print(f"  {example}")
    print(f"model: {args.model_type}, {tok.sp_vocab_size} pieces + {tok.extra_ids} sentinels = "
          f"{tok.vocab_size} ids (pad={tok.pad_id}, eos={tok.eos_id}, unk={tok.unk_id}, no bos, "
          f"byte fallback {'on' if args.byte_fallback else 'off'})")
    if modes:
        print("UL2 mode tokens: " + ", ".join(f"{t} = {tid}" for t, tid in modes))
    print(f"wrote {args.output_prefix}.model and {args.output_prefix}.vocab in {elapsed:.1f} s")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command line entry point; returns the exit code."""
    args = get_args(argv)
    if args.extend is not None:
        return extend(args)
    return train(args)


if __name__ == "__main__":
    sys.exit(main())
