"""`train_tokenizer.py --extend OLD --add-pieces N`: CPM-2's bilingual stage for tokenizers.

    python data_tools/train_tokenizer.py --extend spm/zh.model --input en/*.jsonl \\
        --add-pieces 8000 --output-prefix spm/zh_en
    python data_tools/train_tokenizer.py --extend bpe_cn/vocab.txt --input en/*.jsonl \\
        --add-pieces 8000 --output-prefix out/bpe_cn_plus_en

trains N pieces on the input (SentencePiece, with the old model's type, normalization and
splitting rules; for a CPM-2 vocab.txt a BPE model on CPM-2-normalized text, its pieces written
CPM-2's way: `word`, `##piece`) and writes the old vocabulary with those of the N that it lacks
after it (megatron/data/tokenizers/extend.py says where the sentinels go):
PREFIX.model and PREFIX.vocab for a SentencePiece model, PREFIX/vocab.txt for CPM-2.
Then `convert_checkpoint.py --extend-vocab` grows a checkpoint's embedding to match.
Exit status as train_tokenizer.py's.
"""

from __future__ import annotations

import io
import os
import sys
import time
from pathlib import Path

import sentencepiece as spm

from data_tools.tokenizer_corpus import Corpus, InputError, check_readable, remove
from megatron.data.preprocess.jsonl import expand_inputs
from megatron.data.tokenizers import extend as ext
from megatron.data.tokenizers.cpm2_tokenizer import CPM2Tokenizer, load_vocabulary
from megatron.data.tokenizers.tokenizer import T5Tokenizer, resolve_tokenizer


class _Normalized:
    """The corpus's sentences through `normalize` (CPM-2's full-width to half-width)."""

    def __init__(self, corpus, normalize):
        self.corpus, self.normalize = corpus, normalize

    def __iter__(self):
        return (self.normalize(s) for s in self.corpus)


def _train_pieces(sentences, corpus, args, options) -> "tuple[int, list]":
    """(exit code, [(piece, score)] of the trained model's ordinary pieces)."""
    model = io.BytesIO()
    spm.set_random_generator_seed(args.seed)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences), model_writer=model,
            vocab_size=args.add_pieces + 3, character_coverage=args.character_coverage,
            byte_fallback=False, input_sentence_size=args.input_sentence_size,
            shuffle_input_sentence=True, max_sentence_length=args.max_sentence_length,
            num_threads=args.num_threads, pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
            minloglevel=0 if args.verbose else 2, **options)
    except (RuntimeError, InputError) as e:
        if corpus.error is not None:
            print(f"error: {corpus.error}", file=sys.stderr)
            return 2, []
        if corpus.sentences == 0:
            print(f"error: no text to train on ({corpus.docs} documents, {corpus.bad} bad "
                  "lines)", file=sys.stderr)
            return 1, []
        msg = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
        print(f"error: SentencePiece training failed: {msg.rsplit('] ', 1)[-1]}",
              file=sys.stderr)
        return 1, []
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model.getvalue())
    return 0, ext.normal_pieces(proto)


def _extend_sentencepiece(args, corpus, prefix: str) -> int:
    old_proto = ext.load_model_proto(args.extend)
    old = T5Tokenizer(args.extend)  # checks the T5 layout
    rc, trained = _train_pieces(corpus, corpus, args, ext.trainer_options_like(old_proto))
    if rc:
        return rc
    proto, added = ext.extend_model_proto(old_proto, trained)
    tmp = f"{prefix}.tmp-{os.getpid()}"
    try:
        Path(tmp + ".model").write_bytes(proto.SerializeToString())
        Path(tmp + ".vocab").write_text("\n".join(ext.vocab_lines(proto)) + "\n",
                                        encoding="utf-8")
        new = T5Tokenizer(tmp + ".model")
        if any(new.id_to_piece(i) != old.id_to_piece(i) for i in range(old.sp_vocab_size)):
            print("error: the extended model changed an old piece's id", file=sys.stderr)
            return 1
        os.replace(tmp + ".vocab", prefix + ".vocab")
        os.replace(tmp + ".model", prefix + ".model")
    finally:
        remove([tmp + ".model", tmp + ".vocab"])
    print(f"added {len(added)} of the {len(trained)} pieces trained ({len(trained) - len(added)} "
          f"were in {args.extend} already): {old.sp_vocab_size} + {len(added)} = "
          f"{new.sp_vocab_size} pieces + {new.extra_ids} sentinels = {new.vocab_size} ids; the "
          f"old pieces keep their ids, the sentinels move up by {len(added)} "
          f"(<extra_id_0> = {new.sentinel_ids[0] if new.extra_ids else '-'})")
    print(f"wrote {args.output_prefix}.model and {args.output_prefix}.vocab")
    return 0


def _extend_cpm2(args, corpus, vocab_path: str, prefix: str) -> int:
    old_lines = load_vocabulary(vocab_path)
    normalize = CPM2Tokenizer(vocab_path).normalize  # CPM-2's full-width to half-width
    options = dict(model_type="bpe", normalization_rule_name="identity", add_dummy_prefix=True,
                   split_by_whitespace=True, split_digits=False)
    rc, trained = _train_pieces(_Normalized(corpus, normalize), corpus, args, options)
    if rc:
        return rc
    pieces = ext.cpm2_pieces_from_sentencepiece(p for p, _ in trained)
    lines, added = ext.extend_cpm2_vocabulary(old_lines, pieces, vocab_path)
    out = Path(prefix)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f"vocab.txt.tmp-{os.getpid()}"
    try:
        tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
        load_vocabulary(str(tmp))  # every line once, CPM-2's special pieces there
        os.replace(tmp, out / "vocab.txt")
    finally:
        remove([str(tmp)])
    sentinels = sum(1 for p in lines if p.startswith("<s_"))
    # --add-pieces N trains N pieces: the count is of those, and the few without a CPM-2 form
    # (the bare word start, a piece with whitespace, a repeat once written CPM-2's way) are named
    dropped = len(trained) - len(pieces)
    print(f"added {len(added)} of the {len(trained)} pieces trained ("
          + (f"{dropped} without a CPM-2 form; " if dropped else "")
          + f"{len(pieces) - len(added)} were in {vocab_path} already): {len(old_lines)} + "
          f"{len(added)} = {len(lines)} lines; the old pieces keep their ids, the {sentinels} "
          f"sentinels move up by {len(added)} to the end")
    print(f"wrote {out / 'vocab.txt'}")
    return 0


def extend(args) -> int:
    """`--extend`: train the new pieces and write the extended vocabulary; the exit code."""
    start = time.perf_counter()
    try:
        spec = resolve_tokenizer(args.extend, path_flag="--extend")
        paths = expand_inputs(args.input)
        corpus = Corpus(paths, args)
        for path in paths:
            check_readable(path)
    except (FileNotFoundError, InputError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    prefix = os.path.abspath(args.output_prefix)
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    try:
        if spec.tokenizer_type == "CPM2Tokenizer":
            rc = _extend_cpm2(args, corpus, spec.path, prefix)
        else:
            args.extend = spec.path
            rc = _extend_sentencepiece(args, corpus, prefix)
    except ValueError as e:  # a vocabulary that cannot be read or extended; names the file
        print(f"error: {e}", file=sys.stderr)
        return 2
    if rc == 0:
        print(f"inputs: {len(paths)} file(s), {corpus.docs} documents, {corpus.sentences} lines "
              f"({time.perf_counter() - start:.1f} s)")
    return rc
