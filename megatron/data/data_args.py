"""The data flags (Megatron / CPM-2 names), shared by training and `data_tools/build_indices.py`.

`add_data_args(parser)` adds them; `check_data_args(args)` lists every problem at once;
`data_config_from_args(args)` and `sample_counts_from_args(args)` turn them into what
`megatron.data.datasets.builder.build_datasets` takes. For training, `resolve_data(flags, ...)` returns
the data part of the run configuration (`DataSettings`) with every problem of the data flags,
the tokenizer and the sizes it must fit.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

from megatron.data.storage import object_storage
from megatron.data.datasets.builder import (
    OBJECTIVES,
    DataConfig,
    data_file_problems,
    data_kind_problems,
    eod_problems,
    split_sample_counts,
)
from megatron.data.storage.data_meta import APPEND_EOD_MODES, SAMPLE_DOCUMENTS
from megatron.data.storage.indexed_dataset import IMPLS
from megatron.data.storage.object_storage import ObjectStorage, StorageSettings
from megatron.data.datasets.seq2seq import Seq2SeqConfig, source_problems
from megatron.data.datasets.ul2 import (
    DEFAULT_MODE_TOKENS,
    S_PREFIX,
    UL2Config,
    mode_token_ids,
    mode_token_pieces,
    parse_denoisers,
)
from megatron.data.datasets.t5_dataset import T5DatasetConfig
from megatron.data.tokenizers.tokenizer import TOKENIZER_TYPES, TokenizerSpec, build_tokenizer, \
    resolve_tokenizer


DATA_PATH_FLAGS = {
    "data_path": ("--data-path", ("s3",)),
    "data_cache_path": ("--data-cache-path", ()),
    "object_storage_cache_path": ("--object-storage-cache-path", ()),
    "tokenizer_model": ("--tokenizer-model", ()),
    "vocab_file": ("--vocab-file", ()),
    "finetune_data": ("--finetune-data", ()),
    "finetune_valid_data": ("--finetune-valid-data", ()),
    "ul2_denoisers": ("--ul2-denoisers", ()),
}
"""The path flags of `add_data_args`: dest -> (flag, the URL schemes it reads; only data
prefixes are read from s3://), for megatron.data.storage.paths.path_flag_problems."""


@dataclass(frozen=True)
class DataSettings:
    """The datasets (`DataConfig`, with the resolved sequence lengths) and how they are read."""

    dataset: DataConfig
    tokenizer_model: str = ""
    """The tokenizer's file: a SentencePiece .model or a CPM-2 vocab.txt."""
    vocab_extra_ids: int = 100
    num_workers: int = 1
    """Data-loader worker processes."""

    tokenizer_type: str = "SentencePieceTokenizer"
    """`megatron.data.tokenizers.tokenizer.TOKENIZER_TYPES`: which tokenizer reads `tokenizer_model`."""
    object_storage: StorageSettings = StorageSettings()
    """How s3:// prefixes are read (the --object-storage-* flags): the loaders read through an
    ObjectStorage made from it."""

    @property
    def tokenizer(self) -> TokenizerSpec:
        return TokenizerSpec(self.tokenizer_type, self.tokenizer_model)

    @property
    def encoder_seq_length(self) -> int:
        return self.dataset.t5.encoder_seq_length

    @property
    def decoder_seq_length(self) -> int:
        return self.dataset.t5.decoder_seq_length

    @property
    def seed(self) -> int:
        return self.dataset.t5.seed


def add_data_args(parser: argparse.ArgumentParser,
                  schedule: bool = True) -> argparse.ArgumentParser:
    """Add the data flags; with `schedule`, also the few schedule flags that fix sample counts
    (the training parser defines those itself, with micro batches and sample-based schedules)."""
    g = parser.add_argument_group("data")
    g.add_argument("--data-path", nargs="+", required=True,
                   help="PREFIX, or W1 PREFIX1 W2 PREFIX2 ..., or several prefixes (weights "
                        "proportional to their token counts); a PREFIX is a .bin/.idx pair or "
                        "the name of a shard set (preprocess_data.py --num-shards: its "
                        "PREFIX.shards.json), read as the merged file")
    g.add_argument("--split", default="969,30,1",
                   help="train,valid,test proportions of each dataset's documents")
    g.add_argument("--data-impl", default="infer", choices=IMPLS,
                   help="format of the .bin/.idx files (infer reads it from the .idx)")
    g.add_argument("--data-cache-path", default=None,
                   help="where index caches go (default: PREFIX_cache/ next to local data; "
                        "for s3://BUCKET/KEY, ~/.cache/t5-pretrain/object-storage/s3/BUCKET/"
                        "KEY_cache, node-local; given, DIR/s3/BUCKET/KEY_cache for those)")
    g.add_argument("--data-append-eod", choices=APPEND_EOD_MODES, default="auto",
                   help="whether the documents end with EOD (preprocess_data.py --append-eod); "
                        "those that do not get one between them when packed. auto: the "
                        "PREFIX.meta.json that preprocess_data.py writes, checked against a "
                        f"sample of {SAMPLE_DOCUMENTS} document ends, or that sample alone "
                        "(Megatron-LM's data); a sample that disagrees with itself or with the "
                        "file is refused. yes / no: settles it for every prefix, reading nothing")
    g.add_argument("--data-cache-timeout", type=float, default=3600.0,
                   help="seconds a rank waits for another to build an index cache")
    g.add_argument("--tokenizer-model", "--tokenizer-path", dest="tokenizer_model",
                   help="SentencePiece .model, CPM-2 vocab.txt, or a folder holding one "
                        "(CPM-2's bpe_cn)")
    g.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None,
                   help="default: from the file (vocab.txt: CPM2Tokenizer, else SentencePiece)")
    g.add_argument("--vocab-file", default=None,
                   help="CPM-2 vocab.txt (Megatron's spelling; instead of --tokenizer-model)")
    g.add_argument("--vocab-extra-ids", type=int, default=100,
                   help="sentinel tokens <extra_id_i> on top of the SentencePiece pieces (a "
                        "CPM-2 vocabulary has its own <s_i>)")
    g.add_argument("--encoder-seq-length", "--seq-length", "--enc-seq-length",
                   dest="encoder_seq_length", type=int, default=512,
                   help="encoder tokens per sample")
    g.add_argument("--decoder-seq-length", "--dec-seq-length", dest="decoder_seq_length",
                   type=int, default=None,
                   help="default: the target length that span corruption gives")
    g.add_argument("--noise-density", "--mask-prob", dest="noise_density", type=float,
                   default=0.15, help="fraction of tokens corrupted")
    g.add_argument("--mean-noise-span-length", type=float, default=3.0,
                   help="mean length of a corrupted span")
    g.add_argument("--whole-word-masking", action="store_true",
                   help="noise spans never split a word (SentencePiece: at '▁'; CPM-2: a piece "
                        "and its ## continuations)")
    g.add_argument("--seed", type=int, default=1234,
                   help="seeds the data order, the noise and the weights")
    g.add_argument("--t5-objective", choices=OBJECTIVES, default="span-corruption",
                   help="span-corruption: T5's, on _text_document data; megatron: Megatron's "
                        "geometric n-gram masking on _text_sentence data; ul2: UL2's mixture of "
                        "denoisers on _text_document data; seq2seq: the (input, target) pairs "
                        "of --finetune-data (which implies it) (CPM-2 three-file data is "
                        "recognised by its files)")
    g.add_argument("--ul2-denoisers", default="ul2",
                   help="--t5-objective ul2: the mixture: a preset (ul2: the paper's seven, "
                        "equal weights; upalm: 50%% S, 25%% R, 25%% X), a JSON file or inline "
                        "JSON [{\"kind\": \"R\", \"mean_span\": 3, \"rate\": 0.15, "
                        "\"weight\": 1}, ...]")
    g.add_argument("--ul2-s-prefix", choices=S_PREFIX, default="t5",
                   help="the S denoiser's prefix length: uniform over [1, L-1] (t5: the t5 "
                        "library's random_prefix_noise_mask) or so that the target is the S "
                        "rate of the window on average (density)")
    g.add_argument("--ul2-sample-layout", choices=("packed", "megatron"), default="packed",
                   help="--t5-objective ul2: what a sample's raw tokens are: packed (span "
                        "corruption's windows over _text_document data, across documents) or "
                        "megatron (Megatron's T5 rows: whole sentences of one document, "
                        "_text_sentence data, --short-seq-prob)")
    g.add_argument("--ul2-no-mode-tokens", action="store_true",
                   help="do not prepend the mode tokens ([NLU], [NLG], [S2S]) to the input")
    for kind, token in DEFAULT_MODE_TOKENS.items():
        g.add_argument(f"--ul2-{kind.lower()}-denoiser-token", default=token,
                       help=f"the {kind} denoisers' mode token: a piece of the vocabulary "
                            "(its one id: train_tokenizer.py --ul2-mode-tokens), other text "
                            "(tokenized) or ids (\"32099\" or \"5,6\")")
    g.add_argument("--short-seq-prob", type=float, default=0.1,
                   help="--t5-objective megatron (and ul2 with --ul2-sample-layout megatron): "
                        "probability of a shorter sample")
    g.add_argument("--max-ngram", type=int, default=10,
                   help="--t5-objective megatron: longest masked n-gram")
    add_finetune_args(parser)
    add_object_storage_args(parser)
    if not schedule:
        return parser
    g = parser.add_argument_group("schedule (for sample counts)")
    g.add_argument("--train-iters", type=int, required=True)
    g.add_argument("--global-batch-size", type=int, required=True,
                   help="samples per optimizer step over all data-parallel ranks")
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    return parser


def add_finetune_args(parser: argparse.ArgumentParser) -> None:
    """Seq2seq fine-tuning on (input, target) pairs (megatron/data/datasets/seq2seq.py)."""
    g = parser.add_argument_group("fine-tuning (seq2seq pairs; docs/finetuning.md)")
    g.add_argument("--finetune-data", default=None,
                   help="the training pairs instead of --data-path: a JSONL file (one object "
                        "per line, --input-key and --target-key) or the --output-prefix of "
                        "preprocess_data.py --json-keys INPUT TARGET; one example per row, "
                        "padded, longer ones cut (EOS kept); needs --decoder-seq-length")
    g.add_argument("--finetune-valid-data", default=None,
                   help="the validation pairs (same forms); without it no validation")
    g.add_argument("--input-key", default="input", help="the pairs' input key")
    g.add_argument("--target-key", default="target", help="the pairs' target key")
    g.add_argument("--label-words", nargs="+", default=None,
                   help="a label task's words: validation reports the accuracy of the "
                        "generated labels (a prediction equal to none of them is wrong)")
    g.add_argument("--finetune-metrics", default=None, metavar="NAMES",
                   help="validation's task metrics, comma-separated: exact_match, "
                        "label_accuracy, first_token_accuracy, rouge_l, bleu "
                        "(docs/evaluation.md; default: exact_match, and label_accuracy with "
                        "--label-words)")
    g.add_argument("--eval-num-beams", type=int, default=1, metavar="N",
                   help="beam search of N beams for the generated metrics (1: greedy)")
    g.add_argument("--eval-bleu-tokenize", default=None, metavar="NAME",
                   help="sacrebleu's tokenizer for bleu (default 13a; zh for Chinese targets)")
    g.add_argument("--eval-rouge-tokenize", default=None, choices=("words", "chars"),
                   help="rouge_l's tokens: words (rouge-score's default tokenizer, ASCII "
                        "words only; the default) or chars (each character, for Chinese)")


def finetune_problems(flags: Mapping[str, Any]) -> List[str]:
    """Every problem of the --finetune-* flags, their files included (a JSONL file is read
    once, a preprocessed pair's indexes opened)."""
    get = flags.get
    train, valid = get("finetune_data"), get("finetune_valid_data")
    if train is None:
        return [f"{flag} needs --finetune-data" for flag, value in
                (("--finetune-valid-data", valid), ("--label-words", get("label_words")))
                if value is not None]
    problems = []
    if get("data_path") is not None:
        problems.append("--finetune-data reads its pairs instead of --data-path: give one of "
                        "them")
    if get("t5_objective", "span-corruption") not in ("span-corruption", "seq2seq"):
        problems.append(f"--t5-objective {get('t5_objective')} cannot read --finetune-data "
                        "(its pairs are the seq2seq objective)")
    if get("decoder_seq_length") is None:
        problems.append("--finetune-data needs --decoder-seq-length (the target tokens per "
                        "sample, EOS included; longer targets are cut)")
    input_key, target_key = get("input_key", "input"), get("target_key", "target")
    if input_key == target_key:
        problems.append(f"--input-key and --target-key are both {input_key!r}")
        return problems
    words = get("label_words")
    if words is not None:
        if any(not w.strip() for w in words):
            problems.append("--label-words: a label word is empty")
        if len(set(words)) != len(words):
            problems.append("--label-words has a word twice")
    for flag, path in (("--finetune-data", train), ("--finetune-valid-data", valid)):
        if path is not None:
            problems += source_problems(flag, path, input_key, target_key)
    return problems


def objective_of(args: argparse.Namespace) -> str:
    """--t5-objective, or seq2seq with --finetune-data."""
    if getattr(args, "finetune_data", None) is not None:
        return "seq2seq"
    return args.t5_objective


def add_object_storage_args(parser: argparse.ArgumentParser, group=None, only=None) -> None:
    """How s3:// data is read (megatron/data/storage/object_storage.py). `group`: the argument
    group to add them to (default: their own); `only`: the flags to add (default: all; the
    checkpoint tools take those that matter to a download)."""
    d = StorageSettings()
    g = group or parser.add_argument_group(
        "data on object storage (s3:// prefixes; endpoint and keys from AWS_ENDPOINT_URL, "
        "AWS_ACCESS_KEY_ID, AWS_PROFILE, ~/.aws)")
    if only is not None:
        g = _Only(g, only)
    g.add_argument("--object-storage-cache-path", default=None,
                   help="node-local folder for the downloaded .idx files (default: "
                        "--data-cache-path/object-storage, else ~/.cache/t5-pretrain/"
                        "object-storage)")
    g.add_argument("--object-storage-read-ahead", type=int, default=d.read_ahead,
                   help="batches of each loader process whose byte ranges are fetched ahead "
                        "of use (0: fetch each batch when it is built)")
    g.add_argument("--object-storage-block-cache-mib", type=int, default=d.block_cache_mib,
                   help="MiB of fetched ranges kept per data file and loader process (LRU)")
    g.add_argument("--object-storage-max-connections", type=int, default=d.max_connections,
                   help="concurrent requests per loader process")
    g.add_argument("--object-storage-retries", type=int, default=d.retries,
                   help="attempts of a request (backoff doubling from 0.1 s) before the run "
                        "stops with an error naming the object and byte range")
    g.add_argument("--object-storage-timeout", type=float, default=d.timeout_s,
                   help="seconds a request may wait to connect or for data")
    g.add_argument("--object-storage-reader", choices=("sigv4", "boto3"), default=d.reader,
                   help="what sends the data files' ranged GETs: sigv4 (signed requests over "
                        "kept-alive connections, a fraction of boto3's CPU per request) or "
                        "boto3 (endpoint and credentials are boto3's either way)")


class _Only:
    """An argument group that adds only the flags named in `only`."""

    def __init__(self, group, only) -> None:
        self.group, self.only = group, set(only)

    def add_argument(self, flag: str, **kwargs) -> None:
        if flag in self.only:
            self.group.add_argument(flag, **kwargs)


def storage_settings_from_args(flags: Mapping[str, Any]) -> StorageSettings:
    """The --object-storage-* flags (`vars(namespace)`; a parser without them: the defaults)."""
    get = flags.get
    d = StorageSettings()
    cache = get("object_storage_cache_path")
    if cache is None and get("data_cache_path"):
        cache = str(Path(get("data_cache_path")) / "object-storage")
    return StorageSettings(
        cache_path=cache, read_ahead=get("object_storage_read_ahead", d.read_ahead),
        block_cache_mib=get("object_storage_block_cache_mib", d.block_cache_mib),
        max_connections=get("object_storage_max_connections", d.max_connections),
        retries=get("object_storage_retries", d.retries),
        timeout_s=get("object_storage_timeout", d.timeout_s),
        reader=get("object_storage_reader", d.reader))


def object_storage_problems(settings: StorageSettings,
                            data_timeout_minutes: Optional[float] = None) -> List[str]:
    """Out-of-range --object-storage-* flags; and retries that could outlast the loader's
    watchdog (`--data-timeout-minutes`): a failing read must end in its own error, which names
    the object and the byte range, before the watchdog's."""
    problems = []
    worst = object_storage.worst_read_seconds(settings)
    if data_timeout_minutes is not None and worst >= 60 * data_timeout_minutes:
        problems.append(
            f"--object-storage-retries {settings.retries} with --object-storage-timeout "
            f"{settings.timeout_s:g} can keep a read failing for {worst:.0f} s, past "
            f"--data-timeout-minutes {data_timeout_minutes:g}: lower them or raise the timeout")
    for flag, value, low in (("--object-storage-read-ahead", settings.read_ahead, 0),
                             ("--object-storage-block-cache-mib", settings.block_cache_mib, 1),
                             ("--object-storage-max-connections", settings.max_connections, 1),
                             ("--object-storage-retries", settings.retries, 1)):
        if value < low:
            problems.append(f"{flag} {value} must be >= {low}")
    if settings.timeout_s <= 0:
        problems.append(f"--object-storage-timeout {settings.timeout_s} must be positive")
    return problems


def check_data_args(args: argparse.Namespace) -> List[str]:
    """Every problem with the data flags (empty when they are fine)."""
    problems = []
    for flag in ("encoder_seq_length", "train_iters", "global_batch_size"):
        if getattr(args, flag) <= 0:
            problems.append(f"--{flag.replace('_', '-')} must be positive")
    if args.decoder_seq_length is not None and args.decoder_seq_length <= 0:
        problems.append("--decoder-seq-length must be positive")
    if not 0 < args.noise_density < 1:
        problems.append(f"--noise-density {args.noise_density} must be in (0, 1)")
    if args.mean_noise_span_length < 1:
        problems.append("--mean-noise-span-length must be >= 1")
    if args.eval_iters < 0 or args.eval_interval < 0:
        problems.append("--eval-iters and --eval-interval must be >= 0")
    if not 0 <= args.short_seq_prob <= 1:
        problems.append(f"--short-seq-prob {args.short_seq_prob} must be in [0, 1]")
    if args.max_ngram < 1:
        problems.append("--max-ngram must be >= 1")
    if args.t5_objective == "megatron" and args.decoder_seq_length is None:
        problems.append("--t5-objective megatron needs --decoder-seq-length")
    if args.t5_objective == "seq2seq" and getattr(args, "finetune_data", None) is None:
        problems.append("--t5-objective seq2seq needs --finetune-data")
    if not problems and objective_of(args) in ("span-corruption", "ul2"):
        try:
            t5_config_from_args(args).lengths()
        except ValueError as e:
            problems.append(str(e))
    return problems


def t5_config_from_args(args: argparse.Namespace) -> T5DatasetConfig:
    """Raises ValueError (the flag named) for UL2 settings that cannot make samples."""
    ul2 = ul2_config_from_args(args) if args.t5_objective == "ul2" else None
    return T5DatasetConfig(encoder_seq_length=args.encoder_seq_length,
                           decoder_seq_length=args.decoder_seq_length,
                           noise_density=args.noise_density,
                           mean_noise_span_length=args.mean_noise_span_length,
                           whole_word=args.whole_word_masking, seed=args.seed, ul2=ul2)


@functools.lru_cache(maxsize=4)
def _mode_tokenizer(spec: TokenizerSpec, extra_ids: int):
    """The tokenizer the mode tokens are tokenized by: loaded once, though validation makes the
    UL2 config several times."""
    return build_tokenizer(spec, extra_ids=extra_ids)


def ul2_config_from_args(args: argparse.Namespace) -> UL2Config:
    """The --ul2-* flags, the mode tokens tokenized by the run's tokenizer.

    Raises:
        ValueError: every problem, the flags named."""
    denoisers = parse_denoisers(args.ul2_denoisers)
    tokenizer = _mode_tokenizer(tokenizer_spec_from_args(args), args.vocab_extra_ids)
    modes = pieces = None
    if not args.ul2_no_mode_tokens:
        texts = {k: getattr(args, f"ul2_{k.lower()}_denoiser_token") for k in DEFAULT_MODE_TOKENS}
        modes = mode_token_ids(tokenizer, texts)
        pieces = mode_token_pieces(tokenizer, texts, modes)  # the start's warning names them
    config = UL2Config(denoisers, modes, args.ul2_s_prefix, pieces)
    problems = config.problems(args.encoder_seq_length, len(tokenizer.sentinel_ids))
    if problems:
        raise ValueError("; ".join(problems))
    return config


def data_config_from_args(args: argparse.Namespace) -> DataConfig:
    seq2seq = None
    if objective_of(args) == "seq2seq":
        seq2seq = Seq2SeqConfig(args.finetune_data, args.finetune_valid_data, args.input_key,
                                args.target_key, tokenizer_spec_from_args(args),
                                args.vocab_extra_ids, tuple(args.label_words or ()),
                                **_scoring_flags(args))
    return DataConfig(data_path=args.data_path if seq2seq is None else (), split=args.split,
                      data_impl=args.data_impl, data_cache_path=args.data_cache_path,
                      cache_timeout=args.data_cache_timeout, seq2seq=seq2seq,
                      t5=t5_config_from_args(args), objective=objective_of(args),
                      short_seq_prob=args.short_seq_prob, max_ngram=args.max_ngram,
                      ul2_layout=args.ul2_sample_layout,
                      append_eod=getattr(args, "data_append_eod", "auto"))


def _scoring_flags(args: argparse.Namespace) -> Dict[str, Any]:
    """Seq2SeqConfig's scoring fields from --finetune-metrics and the --eval-* flags (checked
    by megatron/evaluation/task_metrics.py's flag_problems; absent from a tool's namespace:
    the defaults)."""
    names = getattr(args, "finetune_metrics", None) or ""
    return dict(metrics=tuple(n.strip() for n in names.split(",") if n.strip()),
                eval_num_beams=getattr(args, "eval_num_beams", 1),
                bleu_tokenize=getattr(args, "eval_bleu_tokenize", None),
                rouge_tokenize=getattr(args, "eval_rouge_tokenize", None))


def sample_counts_from_args(args: argparse.Namespace) -> Tuple[int, int, int]:
    return split_sample_counts(args.train_iters, args.global_batch_size, args.eval_interval,
                               args.eval_iters)


def tokenizer_flag(args: argparse.Namespace) -> str:
    """How messages name the tokenizer flag the user gave."""
    if getattr(args, "vocab_file", None) is not None:
        return "--vocab-file"
    # A folder is CPM-2's spelling (--tokenizer-path bpe_cn); a file Megatron's.
    path = args.tokenizer_model
    return "--tokenizer-path" if path is not None and Path(path).is_dir() \
        else "--tokenizer-model"


def tokenizer_spec_from_args(args: argparse.Namespace) -> TokenizerSpec:
    """The tokenizer the flags name (`resolve_tokenizer`; raises its ValueError)."""
    return resolve_tokenizer(args.tokenizer_model, args.tokenizer_type, args.vocab_file,
                             path_flag=tokenizer_flag(args))


def tokenizer_problems(spec: TokenizerSpec, extra_ids: int, vocab_size: int,
                       flag: str = "--tokenizer-model") -> List[str]:
    """The tokenizer must load and its ids must fit the model's embedding of `vocab_size`
    rows."""
    try:
        size = len(build_tokenizer(spec, extra_ids))
    except (ValueError, ImportError) as e:  # their messages name the file
        return [f"{flag}: {e}"]
    except Exception as e:  # noqa: BLE001 - sentencepiece raises plain RuntimeErrors
        return [f"{flag} {spec.path}: cannot be loaded ({e})"]
    if size <= vocab_size:
        return []
    if spec.tokenizer_type == "CPM2Tokenizer":
        return [f"{flag} {spec.path} (a CPM-2 vocabulary) has {size} ids but the model's "
                f"vocab_size is {vocab_size}; raise vocab_size in --model-config to at least "
                f"{size}"]
    return [f"{flag} {spec.path} has {size} ids (with {extra_ids} sentinels) but the model's "
            f"vocab_size is {vocab_size}; raise vocab_size in --model-config or lower "
            "--vocab-extra-ids"]


def _run_tokenizer(spec: TokenizerSpec, args: argparse.Namespace) -> Optional[tuple]:
    """(the run's tokenizer, its type, its flag and path) as data_kind_problems compares the
    sidecars' with it; None when it cannot be loaded (tokenizer_problems says why)."""
    try:
        tokenizer = _mode_tokenizer(spec, args.vocab_extra_ids)
    except Exception:  # noqa: BLE001 - sentencepiece raises plain RuntimeErrors
        return None
    return tokenizer, spec.tokenizer_type, f"{tokenizer_flag(args)} {spec.path}"


def resolve_data(flags: Mapping[str, Any], vocab_size: Optional[int],
                 schedule: Optional[Tuple[int, int]], too_few_samples: bool
                 ) -> Tuple[Optional[DataSettings], List[str]]:
    """The data part of a training run from its flags (`vars(namespace)`, not modified).

    vocab_size: the model's (None: unknown, the tokenizer is not sized against it).
    schedule: (train_iters, global_batch_size) once both are known, else None (the sample
        counts and lengths are not checked).
    too_few_samples: --train-samples gave no whole step (reported by the caller, so the
        data's "--train-iters must be positive" is left out).
    Returns (settings, problems); settings is None when the flags cannot run.
    """
    problems: List[str] = []
    tokenizer = None
    try:
        tokenizer = tokenizer_spec_from_args(argparse.Namespace(**flags))
    except ValueError as e:
        problems.append(str(e))
    if tokenizer is not None and vocab_size is not None:
        problems += tokenizer_problems(tokenizer, flags["vocab_extra_ids"], vocab_size,
                                       tokenizer_flag(argparse.Namespace(**flags)))
    storage = storage_settings_from_args(flags)
    storage_problems = object_storage_problems(storage, flags.get("data_timeout_minutes"))
    problems += storage_problems
    store = ObjectStorage(storage)  # what the checks below read through
    if flags["data_path"] is not None and not storage_problems:
        problems += data_file_problems(flags["data_path"], flags["data_impl"], store)
    problems += finetune_problems(flags)
    finetune = flags.get("finetune_data") is not None
    if flags["num_workers"] < 0:
        problems.append("--num-workers must be >= 0")
    if schedule is None or (flags["data_path"] is None and not finetune):
        return None, problems
    view = argparse.Namespace(**{**flags, "train_iters": schedule[0],
                                 "global_batch_size": schedule[1]})
    data_problems = check_data_args(view)
    if too_few_samples:  # reported by the caller, in terms of the flag that was given
        data_problems = [p for p in data_problems if not p.startswith("--train-iters")]
    problems += data_problems
    if data_problems or tokenizer is None:
        return None, problems
    t5 = t5_config_from_args(view)
    if not finetune:  # seq2seq: the flag's (required)
        t5 = dataclasses.replace(t5, decoder_seq_length=t5.lengths()[2])
    dataset = dataclasses.replace(data_config_from_args(view), t5=t5)
    if not finetune:  # the sidecars' tokenizer, the sentences Megatron's rows need
        sentences = dataset.objective == "megatron" or (
            dataset.objective == "ul2" and dataset.ul2_layout == "megatron")
        problems += data_kind_problems(dataset.data_path, _run_tokenizer(tokenizer, view),
                                       sentences, dataset.data_impl, store)
    if dataset.packs_documents() and not problems:
        # Before the model is built: whether documents end with EOD (data_meta.decide_eod).
        eos_id = _mode_tokenizer(tokenizer, flags["vocab_extra_ids"]).eos_id
        problems += eod_problems(dataset.data_path, eos_id, dataset.append_eod,
                                 dataset.data_impl, store)
        if problems:
            return None, problems
    return DataSettings(dataset, tokenizer.path, flags["vocab_extra_ids"], flags["num_workers"],
                        tokenizer.tokenizer_type, storage), problems
