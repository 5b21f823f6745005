"""Seq2seq pairs for fine-tuning (`--finetune-data`): one (input, target) example per row.

The pairs come from a JSONL file (`--input-key`, `--target-key` of each line's object, tokenized
with the run's tokenizer) or from a preprocessed prefix OUT that `preprocess_data.py
--json-keys input target --output-prefix OUT` wrote (OUT_input_document and OUT_target_document:
document i of one is example i's input, of the other its target).

Nothing is packed: each sample holds one example, padded to `--encoder-seq-length` /
`--decoder-seq-length` and masked (`make_sample`: padding has attention mask 0 and label -100, so
it never counts in the loss). Input and target each end with EOS (added unless the tokens already
end with it: `preprocess_data.py --append-eod`); an example longer than its side's length is cut
to fit, EOS kept as its last token.

Sample i of a split is a pure function of (seed, i): training samples walk the examples in a
seeded permutation per epoch; validation samples walk them in file order, from the first, so
every evaluation sees the same examples, each at most once: a sample past the file's last
example (an evaluation of more samples than the file holds) repeats an example with every label
-100, so that it keeps the batch's shape but counts for nothing (`is_scored`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from megatron.data.datasets.t5_dataset import IGNORE_INDEX, T5SpecialTokens, make_sample
from megatron.data.preprocess.jsonl import BadLine, read_fields
from megatron.data.storage.indexed_dataset import IndexedDataset, dataset_exists


@dataclass(frozen=True)
class Seq2SeqConfig:
    """The --finetune-* flags: where the pairs are and how they are read.

    train: `--finetune-data`, a .jsonl file or a preprocessed prefix (module docstring).
    valid: `--finetune-valid-data` (None: no validation split).
    tokenizer: the run's (a TokenizerSpec), with `extra_ids` sentinels; reads JSONL text.
    label_words: `--label-words`, for the label accuracy of validation (empty: not a label task).
    metrics, eval_num_beams, bleu_tokenize, rouge_tokenize: `--finetune-metrics` (its names;
        empty: the default), `--eval-num-beams`, `--eval-bleu-tokenize`, `--eval-rouge-tokenize`
        (None: not given): how validation scores its decoding (megatron/evaluation/
        task_metrics.py's Scoring).
    """

    train: str
    valid: Optional[str] = None
    input_key: str = "input"
    target_key: str = "target"
    tokenizer: Optional[object] = None
    extra_ids: int = 100
    label_words: Tuple[str, ...] = ()
    metrics: Tuple[str, ...] = ()
    eval_num_beams: int = 1
    bleu_tokenize: Optional[str] = None
    rouge_tokenize: Optional[str] = None


def is_jsonl(path: str) -> bool:
    """Whether `path` names a JSONL file (an existing file, or a .jsonl / .json name) rather
    than a preprocessed prefix."""
    return os.path.isfile(path) or path.endswith((".jsonl", ".json"))


def pair_prefixes(prefix: str, input_key: str, target_key: str) -> Tuple[str, str]:
    """The two token datasets `preprocess_data.py --json-keys INPUT TARGET --output-prefix
    prefix` writes."""
    return f"{prefix}_{input_key}_document", f"{prefix}_{target_key}_document"


def read_jsonl_pairs(path: str, input_key: str, target_key: str) -> List[Tuple[str, str]]:
    """The (input, target) strings of each line of `path` (blank lines skipped; each line
    checked by megatron/data/preprocess/jsonl.py's `parse_line`).

    Raises:
        ValueError: naming the file and line (not UTF-8, not JSON, not an object, a key missing
            or not a string), or a file without examples.
        OSError: the file cannot be read.
    """
    try:
        rows = read_fields(path, (input_key, target_key), ("--input-key", "--target-key"))
    except BadLine as e:
        raise ValueError(str(e)) from None
    if not rows:
        raise ValueError(f"{path}: no examples")
    return [(source, target) for source, target in rows]


def source_problems(flag: str, path: str, input_key: str, target_key: str) -> List[str]:
    """What keeps `path` (given as `flag`) from being read as pairs: a missing file or prefix,
    a bad JSONL line, two prefixes of different document counts. Reads the JSONL file once, or
    the prefixes' indexes."""
    if is_jsonl(path):
        if not os.path.isfile(path):
            return [f"{flag} {path}: no such file"]
        try:
            read_jsonl_pairs(path, input_key, target_key)
        except (OSError, ValueError, UnicodeDecodeError) as e:
            return [f"{flag} {e}"]
        return []
    inputs, targets = pair_prefixes(path, input_key, target_key)
    missing = [p for p in (inputs, targets) if not dataset_exists(p)]
    if missing:
        return [f"{flag} {path}: neither a JSONL file nor a preprocessed pair (no .bin/.idx "
                f"for {', '.join(missing)}; preprocess_data.py --json-keys {input_key} "
                f"{target_key} --output-prefix {path} writes them)"]
    try:
        counts = [IndexedDataset(p).num_documents for p in (inputs, targets)]
    except (OSError, ValueError) as e:
        return [f"{flag} {path}: {e}"]
    if counts[0] != counts[1]:
        return [f"{flag} {path}: {inputs} has {counts[0]} documents but {targets} has "
                f"{counts[1]}; they must be one preprocess_data.py run's pair"]
    if counts[0] == 0:
        return [f"{flag} {path}: no examples"]
    return []


class _JsonlExamples:
    """Token ids of the examples of a JSONL file, tokenized once."""

    def __init__(self, path: str, input_key: str, target_key: str, tokenizer) -> None:
        pairs = read_jsonl_pairs(path, input_key, target_key)
        self.inputs = tokenizer.encode_batch([p[0] for p in pairs])
        self.targets = tokenizer.encode_batch([p[1] for p in pairs])

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, i: int) -> Tuple[np.ndarray, np.ndarray]:
        return (np.asarray(self.inputs[i], dtype=np.int64),
                np.asarray(self.targets[i], dtype=np.int64))


class _PreprocessedExamples:
    """The examples of a preprocessed pair of prefixes, read as they are asked for."""

    def __init__(self, prefix: str, input_key: str, target_key: str) -> None:
        self.parts = [IndexedDataset(p) for p in pair_prefixes(prefix, input_key, target_key)]
        if self.parts[0].num_documents != self.parts[1].num_documents:
            raise ValueError(f"{prefix}: the input and target prefixes differ in documents")

    def __len__(self) -> int:
        return self.parts[0].num_documents

    def __getitem__(self, i: int) -> Tuple[np.ndarray, np.ndarray]:
        def tokens(part: IndexedDataset) -> np.ndarray:
            sequences = part.document(i)
            if not sequences:
                return np.zeros(0, dtype=np.int64)
            return np.concatenate(sequences).astype(np.int64)

        return tokens(self.parts[0]), tokens(self.parts[1])


def open_examples(path: str, input_key: str, target_key: str, tokenizer):
    """The examples of `path` (a JSONL file or a preprocessed prefix): len() and [i] giving
    (input ids, target ids) as stored, without EOS added."""
    if is_jsonl(path):
        return _JsonlExamples(path, input_key, target_key, tokenizer)
    return _PreprocessedExamples(path, input_key, target_key)


def fit(ids: np.ndarray, length: int, eos_id: int) -> np.ndarray:
    """`ids` ending with EOS, cut to at most `length` tokens (EOS kept last)."""
    ids = np.asarray(ids, dtype=np.int64)
    if len(ids) == 0 or ids[-1] != eos_id:
        ids = np.append(ids, eos_id)
    if len(ids) > length:
        ids = np.append(ids[:length - 1], eos_id)
    return ids


class Seq2SeqDataset:
    """`num_samples` samples of the examples (module docstring), each the dict `make_sample`
    gives (as every pretraining dataset's).

    Args:
        name: the split ("train" shuffles per epoch; any other name keeps file order).
        examples: len() and [i] -> (input ids, target ids) (`open_examples`).
    """

    def __init__(self, name: str, examples, num_samples: int, encoder_length: int,
                 decoder_length: int, tokens: T5SpecialTokens, seed: int = 1234) -> None:
        if len(examples) == 0:
            raise ValueError(f"{name}: no examples")
        self.name, self.examples, self.num_samples = name, examples, num_samples
        self.encoder_length, self.decoder_length = encoder_length, decoder_length
        self.tokens, self.seed = tokens, seed
        self.shuffle = name == "train"
        self._orders: Dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.num_samples

    def example_index(self, index: int) -> int:
        """Which example sample `index` holds."""
        epoch, position = divmod(int(index), len(self.examples))
        if not self.shuffle:
            return position
        order = self._orders.get(epoch)
        if order is None:
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self.examples))
            self._orders = {epoch: order}  # one epoch at a time: samples come in order
        return int(order[position])

    def __getitem__(self, index: int) -> Dict[str, np.ndarray]:
        if not 0 <= int(index) < self.num_samples:
            raise IndexError(f"sample {index} out of range for {self.num_samples} samples")
        inputs, targets = self.examples[self.example_index(index)]
        eos = self.tokens.eos_id
        sample = make_sample(fit(inputs, self.encoder_length, eos),
                             fit(targets, self.decoder_length, eos), self.encoder_length,
                             self.decoder_length, self.tokens.pad_id,
                             self.tokens.decoder_start_token_id)
        if not self.shuffle and int(index) >= len(self.examples):
            # validation past the file's end: the batch keeps its shape (the ranks and pipeline
            # stages run the same steps), the example already scored is not scored again
            sample["labels"][:] = IGNORE_INDEX
        return sample


def is_scored(labels) -> bool:
    """Whether a sample (its labels row) is scored: a real example always labels its EOS; a
    validation sample past the file's end labels nothing (module docstring)."""
    return bool((labels != IGNORE_INDEX).any())


def build_seq2seq_datasets(config: Seq2SeqConfig, encoder_length: int, decoder_length: int,
                           seed: int, tokens: T5SpecialTokens,
                           num_samples: Sequence[int]) -> Dict[str, Optional[Seq2SeqDataset]]:
    """{"train", "valid", "test"}: train from `config.train`, valid from `config.valid` (None
    without it or without samples asked), test None."""
    from megatron.data.tokenizers.tokenizer import build_tokenizer

    tokenizer = None
    if any(is_jsonl(p) for p in (config.train, config.valid) if p is not None):
        tokenizer = build_tokenizer(config.tokenizer, extra_ids=config.extra_ids)
    out: Dict[str, Optional[Seq2SeqDataset]] = {"train": None, "valid": None, "test": None}
    for name, path, count in (("train", config.train, num_samples[0]),
                              ("valid", config.valid, num_samples[1])):
        if path is None or count <= 0:
            continue
        examples = open_examples(path, config.input_key, config.target_key, tokenizer)
        out[name] = Seq2SeqDataset(name, examples, count, encoder_length, decoder_length,
                                   tokens, seed)
    return out
