"""CPM-2's offline-corrupted data (`PREFIX_context`, `PREFIX_target`, `PREFIX_target_offset`).

CPM-2-Pretrain corrupts text once, while preprocessing, instead of at training time. A corpus made
by its preprocessing tool trains here unchanged through `CPM2Dataset`. The rules below were worked
out from CPM-2-Pretrain's `src/tools/preprocess_data_enc_dec.py` (the writer),
`src/data/enc_dec_dataset.py` (the reader), `src/pretrain_enc_dec.py` (masks and loss) and
`src/tokenization_enc_dec.py` (special ids); they are restated here in our own words.

Layout on disk
--------------
Three ordinary Megatron indexed datasets (`.bin` + `.idx`, MMIDIDX or the legacy TNTIDX format;
CPM-2 writes uint16 tokens) share one prefix, conventionally `NAME_document`:

    PREFIX_context        one sequence per document: the text with every corrupted span
                          replaced by one placeholder token
    PREFIX_target         one sequence per document: for each span, its placeholder followed by
                          the span's tokens, all spans back to back
    PREFIX_target_offset  one sequence per document: pairs (start, length), one per span, locating
                          span k (placeholder included) inside that document's target sequence

Sequence d of the three files belongs to the same document d, so the three have the same number
of sequences. CPM-2's builder never closes documents, so its `.idx` files have document_indices
[0] whatever N is; `IndexedDataset` rejects such an index, so exactly that shape is read here by a
small checked fallback reader. Sequences, not index "documents", are the unit (as in CPM-2).

How a document is written
-------------------------
The document's tokens get an `<eod>` appended; the span mask alternates kept and noise runs and
always ends with a noise run, so `<eod>` always lands in the last target span and never in the
context. The k-th span of a document (k counted from 0 inside that document) is represented by the
placeholder id `placeholder_base + k`, where `placeholder_base` is the vocabulary size of the
preprocessing tokenizer (CPM-2: `len(vocab.txt)`); every id `>= placeholder_base` in a context is a
placeholder. Context = kept_0 P_0 kept_1 P_1 ... kept_n-1 P_n-1; target = P_0 span_0 P_1 span_1 ...;
offsets = [start_0, len_0, start_1, len_1, ...] with len_k = 1 + len(span_k).

How a sample is made
--------------------
1. Packing. The split's documents are repeated for as many epochs as needed and the whole
   repeated list is shuffled once with `numpy.random.RandomState(seed)`. Their contexts are read
   as one stream and cut GPT-style into windows of `encoder_length` tokens, where each window
   starts on the last token of the previous one (Megatron's sample index for sequence length
   `encoder_length - 1`, which "adds one extra token"); so consecutive windows share one token and
   every window is exactly `encoder_length` tokens long: the encoder input is never padded.
   Windows are then served in an order shuffled by the same RandomState (after the documents).
   A split whose documents hold fewer tokens than one window is not refused: as in CPM-2, the
   epochs added until there are `num_samples` windows make windows that run from one epoch into
   the next (the same document can then appear twice in one window).
2. Sentinels. Scanning a window left to right, the c-th placeholder met (c from 0, counting across
   the documents of the window) is replaced by sentinel c (`<s_c>` in CPM-2, our
   `sentinel_ids[c]`). Its span is fetched through the offsets of the document it came from,
   must begin with the very same placeholder, and its first token is replaced by the same
   sentinel. A window whose first token is a placeholder uses the span again even if the previous
   window already did (the shared token).
3. Decoder. The decoder sequence is [start] + T_0 + T_1 + ... + [sentinel m], where T_c is
   sentinel c followed by the tokens of the c-th span met, start is CPM-2's `<s>` (id 1; our
   `decoder_start_token_id`) and m is the number of placeholders in the window (so a window needs
   m + 1 sentinels). It is cut to `decoder_length + 1` tokens; the decoder input is all but its
   last token and the labels all but its first, both padded to `decoder_length`.
4. Masks. The encoder attends to all of its tokens; the decoder is causal over its real tokens.
   CPM-2's loss ignores padding and also every position whose decoder *input* is `<eod>` (the
   prediction of the sentinel that follows a document's end); with `mask_after_eod` (default) the
   labels are -100 there too. CPM-2's optional `--reset-position-ids/--reset-attention-mask` use
   `ctx_eod_mask` (1 on placeholders whose span holds `<eod>`); `return_encoder_eod_mask` adds it
   as `encoder_eod_mask`.

CPM-2 splits by document (sequence) ranges; here the caller gives the range (see
`builder.parse_split`, which rounds as CPM-2 and Megatron do). Sample i is a pure function of
(seed, i, the files). tests/unit/test_cpm2_reference.py checks all of this against CPM-2's own
reader on data made by CPM-2's own tool: the same samples for every window, field by field.
Differences from CPM-2: it asserts or crashes on bad data, here a ValueError names the file;
`len()` is `num_samples` rather than every window of every epoch (the windows past it remain
reachable as `window(shuffle_idx[i])`); labels are -100 where CPM-2's loss mask is 0 (CPM-2 keeps
the token there, or `<pad>`); `doc_idx` numbers the split's documents from 0 where CPM-2 keeps
their absolute numbers; CPM-2's decoder mask lets padding rows attend to padding keys (ours
masks those keys), rows that carry no loss either way. The optional position and attention resets of CPM-2's
`--reset-position-ids/--reset-attention-mask` are not made here. CPM-2 stores everything as
uint16, so a document with more than 65535 target tokens, or with so many spans that
`placeholder_base + k` passes 65535, was already corrupt when written; offsets that wrapped fail
here with a ValueError when read, placeholders that wrapped only in `validate()`.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

import numpy as np

from megatron.data import _helpers

from megatron.data.storage import object_storage
from megatron.data.storage.index_cache import cached_arrays, description_hash
from megatron.data.storage.indexed_dataset import (
    IndexedDataset,
    Read,
    data_file_path,
    dataset_exists,
    default_cache_dir,
    index_file_path,
    index_identity,
)
from megatron.data.datasets.t5_dataset import IGNORE_INDEX, T5SpecialTokens, make_sample

SUFFIXES = ("_context", "_target", "_target_offset")


def cpm2_prefixes(prefix: str) -> Tuple[str, str, str]:
    """(context, target, target_offset) dataset prefixes of a CPM-2 data prefix."""
    return tuple(str(prefix) + s for s in SUFFIXES)  # type: ignore[return-value]


def is_cpm2_prefix(prefix: str, storage: Optional[object_storage.ObjectStorage] = None) -> bool:
    """True when PREFIX_context, PREFIX_target and PREFIX_target_offset (.bin and .idx each)
    all exist (objects looked up through `storage`, for an s3:// prefix)."""
    return all(dataset_exists(p, storage) for p in cpm2_prefixes(prefix))


def _open(path_prefix: str, impl: str,
          storage: Optional[object_storage.ObjectStorage]) -> IndexedDataset:
    # CPM-2's builder never ends documents: its indices list no documents, one sequence each.
    return IndexedDataset(path_prefix, impl, sequences_are_documents=True, storage=storage)


def _num_epochs(tokens_per_epoch: int, window: int, num_samples: int) -> int:
    """CPM-2's rule: the fewest epochs whose token stream holds num_samples windows of `window`+1
    tokens overlapping by one."""
    epochs = 1
    while (epochs * tokens_per_epoch - 1) // window < num_samples:
        epochs += 1
    return epochs


class CPM2Dataset:
    """Samples of a corpus preprocessed by CPM-2-Pretrain (see the module docstring).

    Args:
        prefix: the data prefix without the `_context`/`_target`/`_target_offset` suffix.
        document_range: (start, end), the documents (sequences) this split uses.
        num_samples: how many samples to serve; epochs are added until there are enough.
        encoder_length: encoder tokens per sample (CPM-2 `--enc-seq-length`); at least 2.
        decoder_length: decoder tokens per sample (CPM-2 `--dec-seq-length`); longer targets are
            cut, as CPM-2 does.
        tokens: pad, eos (taken as CPM-2's `<eod>` unless `eod_id` is given), decoder start (CPM-2
            uses id 1, `<s>`) and the sentinels (CPM-2: `<s_0>`...`<s_189>`); a window needs one
            sentinel per placeholder plus one to close the target.
        seed: the data seed; windows and their order are those CPM-2 makes with the same seed.
        placeholder_base: the vocabulary size the corpus was preprocessed with (every context id
            `>= placeholder_base` is a placeholder, `placeholder_base + k` stands for the
            document's span k). None reads it from the data: each document's target starts with
            placeholder 0, i.e. with `placeholder_base` itself.
        eod_id: CPM-2's `<eod>` id (default `tokens.eos_id`).
        mask_after_eod: labels are -100 where the decoder input is `<eod>` (CPM-2's loss mask).
        return_encoder_eod_mask: add `encoder_eod_mask` (CPM-2's `ctx_eod_mask`) to each sample.
        name: for cache names and messages.
        impl: indexed dataset format ('infer', 'mmap', 'lazy', 'cached').
        cache_dir: where the index cache goes (default `PREFIX_cache/`).
        storage: what an s3:// prefix is read through (None: the default settings).

    Raises:
        ValueError: the three datasets disagree (message names the file), a range or length is
            impossible; later, from `__getitem__`, a window whose placeholders, offsets or spans
            do not match, or that needs more sentinels than `tokens` has.
    """

    def __init__(self, prefix: str, document_range: Tuple[int, int], num_samples: int,
                 encoder_length: int, decoder_length: int, tokens: T5SpecialTokens,
                 seed: int = 1234, placeholder_base: Optional[int] = None,
                 eod_id: Optional[int] = None, mask_after_eod: bool = True,
                 return_encoder_eod_mask: bool = False, name: str = "train",
                 impl: str = "infer", cache_dir: Optional[str] = None,
                 cache_timeout: float = 3600.0,
                 storage: Optional[object_storage.ObjectStorage] = None) -> None:
        self.prefix = str(prefix)
        self.name = name
        self.tokens = tokens
        self.seed = int(seed)
        self.encoder_length = int(encoder_length)
        self.decoder_length = int(decoder_length)
        self.eod_id = int(tokens.eos_id if eod_id is None else eod_id)
        self.mask_after_eod = mask_after_eod
        self.return_encoder_eod_mask = return_encoder_eod_mask
        self._sentinels = np.asarray(tokens.sentinel_ids, dtype=np.int64)
        if self.encoder_length < 2:
            raise ValueError(f"encoder length {encoder_length}: CPM-2 windows need at least 2")
        if self.decoder_length < 1:
            raise ValueError(f"decoder length {decoder_length} must be positive")
        if len(self._sentinels) < 1:
            raise ValueError("no sentinel ids: CPM-2 data needs at least one sentinel")

        ctx_p, tgt_p, off_p = cpm2_prefixes(self.prefix)
        if storage is None and object_storage.is_remote(self.prefix):
            storage = object_storage.ObjectStorage()
        for p in (ctx_p, tgt_p, off_p):
            if not dataset_exists(p, storage):
                missing = [f for f in (index_file_path(p), data_file_path(p))
                           if not (storage.exists(f) if object_storage.is_remote(f)
                                   else os.path.isfile(f))]
                raise FileNotFoundError(f"CPM-2 data {self.prefix}: missing {', '.join(missing)}")
        self.context = _open(ctx_p, impl, storage)
        self.target = _open(tgt_p, impl, storage)
        self.target_offset = _open(off_p, impl, storage)
        self._ctx_file = data_file_path(ctx_p)
        self._tgt_file = data_file_path(tgt_p)
        self._off_file = data_file_path(off_p)

        n = len(self.context)
        if not len(self.target) == len(self.target_offset) == n:
            raise ValueError(
                f"CPM-2 data {self.prefix}: the three datasets disagree on the number of "
                f"documents: {index_file_path(ctx_p)} has {n}, {index_file_path(tgt_p)} has "
                f"{len(self.target)}, {index_file_path(off_p)} has {len(self.target_offset)}")
        start, end = (int(x) for x in document_range)
        if not 0 <= start <= end <= n:
            raise ValueError(f"document range {tuple(document_range)} outside the {n} documents "
                             f"of {index_file_path(ctx_p)}")
        self.document_range = (start, end)
        off_lens = np.asarray(self.target_offset.sequence_lengths[start:end], dtype=np.int64)
        odd = np.flatnonzero(off_lens % 2)
        if len(odd):
            d = start + int(odd[0])
            raise ValueError(f"{index_file_path(off_p)}: document {d} has {int(off_lens[odd[0]])} "
                             "offsets, expected (start, length) pairs (an even count)")

        self._sizes = np.asarray(self.context.sequence_lengths[start:end], dtype=np.int64)
        tokens_per_epoch = int(self._sizes.sum())
        window = self.encoder_length - 1
        # A split shorter than one window is not refused: as in CPM-2, epochs are added until
        # there are enough windows (CPM-2's --split 949,50,1 often leaves valid that short).
        if tokens_per_epoch < 1:
            raise ValueError(f"{name} split of {self.prefix}: documents [{start}, {end}) hold "
                             "no context tokens")
        if num_samples < 0:
            raise ValueError(f"num_samples {num_samples} must not be negative")
        self.num_samples = int(num_samples)
        self.num_epochs = _num_epochs(tokens_per_epoch, window, max(1, self.num_samples))

        self.placeholder_base = (self._infer_placeholder_base() if placeholder_base is None
                                 else int(placeholder_base))

        description = {
            "kind": "cpm2_enc_dec", "name": name, **index_identity(ctx_p, self.prefix, storage),
            "documents": [start, end], "num_epochs": self.num_epochs,
            "encoder_length": self.encoder_length, "seed": self.seed,
        }
        self.cache_key = description_hash(description)
        cache_dir = default_cache_dir(self.prefix, cache_dir)
        arrays = cached_arrays(cache_dir, f"{os.path.basename(self.prefix)}_{name}_cpm2",
                               description, lambda: self._build(tokens_per_epoch),
                               timeout=cache_timeout)
        self.doc_idx = arrays["doc_idx"]
        self.sample_idx = arrays["sample_idx"]
        self.shuffle_idx = arrays["shuffle_idx"]
        self.num_windows = len(self.sample_idx) - 1
        if self.num_windows < self.num_samples:  # only a corrupt cache could do this
            raise ValueError(f"{name}: {self.num_windows} windows for {self.num_samples} samples; "
                             "delete the index cache and retry")

    # -- index ---------------------------------------------------------------------------------

    def _infer_placeholder_base(self) -> int:
        start, end = self.document_range
        lengths = np.asarray(self.target.sequence_lengths[start:end])
        nonempty = np.flatnonzero(lengths > 0)
        if not len(nonempty):
            raise ValueError(f"{index_file_path(self.target.path_prefix)}: every target of "
                             f"documents [{start}, {end}) is empty; cannot read the placeholder "
                             "base, pass placeholder_base")
        return int(self.target.get(start + int(nonempty[0]), 0, 1)[0])

    def _build(self, tokens_per_epoch: int) -> Dict[str, np.ndarray]:
        start, end = self.document_range
        rng = np.random.RandomState(self.seed)
        # CPM-2: all epochs' copies of the documents in one array, shuffled as a whole.
        doc_idx = np.tile(np.arange(end - start, dtype=np.int64), self.num_epochs)
        rng.shuffle(doc_idx)
        sample_idx = _helpers.build_sample_idx(
            self._sizes.astype(np.int32), doc_idx, self.encoder_length - 1, self.num_epochs,
            tokens_per_epoch, True, True)
        shuffle_idx = np.arange(len(sample_idx) - 1, dtype=np.int64)
        rng.shuffle(shuffle_idx)
        return {"doc_idx": doc_idx, "sample_idx": np.asarray(sample_idx, dtype=np.int64),
                "shuffle_idx": shuffle_idx}

    # -- samples -------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.num_samples

    def _pieces(self, j: int) -> List[Tuple[int, int, int]]:
        """(document, begin, end) context slices of window j, in order."""
        (p0, o0), (p1, o1) = self.sample_idx[j], self.sample_idx[j + 1]
        out = []
        for p in range(int(p0), int(p1) + 1):
            doc = int(self.doc_idx[p])
            begin = int(o0) if p == p0 else 0
            stop = int(o1) + 1 if p == p1 else int(self._sizes[doc])
            if stop > begin:
                out.append((self.document_range[0] + doc, begin, stop))
        return out

    def _span(self, doc: int, token: int, offsets: np.ndarray) -> np.ndarray:
        """The target span (placeholder first) of placeholder `token` of document `doc`."""
        k = token - self.placeholder_base
        if 2 * k + 1 >= len(offsets):
            raise ValueError(
                f"{self._ctx_file}: document {doc} has placeholder {token} (span {k}) but "
                f"{self._off_file} holds only {len(offsets) // 2} spans for it (placeholder base "
                f"{self.placeholder_base})")
        begin, length = int(offsets[2 * k]), int(offsets[2 * k + 1])
        target_len = int(self.target.sequence_lengths[doc])
        if begin < 0 or length < 1 or begin + length > target_len:
            raise ValueError(
                f"{self._off_file}: document {doc} span {k} is (start {begin}, length {length}), "
                f"outside its target of {target_len} tokens in {self._tgt_file}")
        span = np.asarray(self.target.get(doc, begin, length), dtype=np.int64)
        if int(span[0]) != token:
            raise ValueError(
                f"{self._tgt_file}: document {doc} span {k} starts with {int(span[0])}, not its "
                f"placeholder {token} (offset {begin} from {self._off_file})")
        return span

    def window(self, j: int) -> Dict[str, np.ndarray]:
        """The sample made from window j in packing order (before the shuffle)."""
        if not 0 <= j < self.num_windows:
            raise IndexError(f"window {j} out of range for {self.num_windows} windows")
        contexts, eod_marks, spans = [], [], []
        for doc, begin, stop in self._pieces(j):
            ctx = np.asarray(self.context.get(doc, begin, stop - begin), dtype=np.int64).copy()
            marks = np.zeros(len(ctx), dtype=np.int64)
            positions = np.flatnonzero(ctx >= self.placeholder_base)
            if np.any(ctx == self.eod_id):
                raise ValueError(f"{self._ctx_file}: document {doc} has <eod> ({self.eod_id}) in "
                                 "its context; CPM-2 puts it in the last target span only")
            offsets = (np.asarray(self.target_offset[doc], dtype=np.int64) if len(positions)
                       else None)
            for pos in positions:
                c = len(spans)
                if c + 1 >= len(self._sentinels):
                    raise ValueError(
                        f"{self._ctx_file}: window {j} needs more sentinels than the "
                        f"{len(self._sentinels)} given (document {doc} adds placeholder {c + 1}, "
                        "and one more closes the target); use a shorter encoder length or more "
                        "sentinels")
                span = self._span(doc, int(ctx[pos]), offsets).copy()
                if np.any(span == self.eod_id):
                    marks[pos] = 1
                ctx[pos] = self._sentinels[c]
                span[0] = self._sentinels[c]
                spans.append(span)
            contexts.append(ctx)
            eod_marks.append(marks)
        inputs = np.concatenate(contexts)
        if len(inputs) != self.encoder_length:  # only a corrupt cache could do this
            raise ValueError(f"{self.name}: window {j} has {len(inputs)} tokens, expected "
                             f"{self.encoder_length}; delete the index cache and retry")
        targets = np.concatenate(spans + [self._sentinels[len(spans):len(spans) + 1]])
        targets = targets[:self.decoder_length]  # CPM-2 cuts [start] + targets to length + 1
        sample = make_sample(inputs, targets, self.encoder_length, self.decoder_length,
                             self.tokens.pad_id, self.tokens.decoder_start_token_id)
        if self.mask_after_eod:
            sample["labels"][sample["decoder_input_ids"] == self.eod_id] = IGNORE_INDEX
        if self.return_encoder_eod_mask:
            sample["encoder_eod_mask"] = np.concatenate(eod_marks)
        return sample

    def _sample_window(self, index: int) -> int:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range for {self.num_samples} samples")
        return int(self.shuffle_idx[index])

    def __getitem__(self, index: int) -> Dict[str, np.ndarray]:
        return self.window(self._sample_window(int(index)))

    def sample_reads(self, index: int) -> List[Read]:
        """The byte ranges of data on object storage that building sample `index` reads of its
        context, in order, without reading them (the read-ahead plans from them; [] for local
        data). The target spans and offsets it reads depend on the context's values (where
        its placeholders are): they are read when the sample is built."""
        return [r for doc, begin, stop in self._pieces(self._sample_window(int(index)))
                for r in self.context.reads(doc, begin, stop - begin)]

    # -- checks --------------------------------------------------------------------------------

    def validate(self) -> None:
        """Check every document of the split as CPM-2's writer makes them (placeholders
        base+0..base+n-1 in order, n offset pairs tiling the target, each span starting with its
        placeholder, no <eod> in the context); raises ValueError naming the file. Reads all
        three files of the split: for a one-off check, not for every start-up."""
        start, end = self.document_range
        base = self.placeholder_base
        for doc in range(start, end):
            ctx = np.asarray(self.context[doc], dtype=np.int64)
            tgt = np.asarray(self.target[doc], dtype=np.int64)
            off = np.asarray(self.target_offset[doc], dtype=np.int64)
            holders = ctx[ctx >= base]
            n = len(off) // 2
            if not np.array_equal(holders, base + np.arange(len(holders))) or len(holders) != n:
                raise ValueError(f"{self._ctx_file}: document {doc} has placeholders "
                                 f"{(holders - base).tolist()[:8]}..., expected 0..{n - 1} for the "
                                 f"{n} spans in {self._off_file}")
            if np.any(ctx == self.eod_id):
                raise ValueError(f"{self._ctx_file}: document {doc} has <eod> in its context")
            starts, lengths = off[0::2], off[1::2]
            ends = np.concatenate([[0], np.cumsum(lengths)])
            if np.any(lengths < 1) or not np.array_equal(starts, ends[:-1]) or \
                    ends[-1] != len(tgt):
                raise ValueError(f"{self._off_file}: document {doc}'s offsets do not tile its "
                                 f"target of {len(tgt)} tokens in {self._tgt_file}")
            if n and not np.array_equal(tgt[starts], base + np.arange(n)):
                raise ValueError(f"{self._tgt_file}: document {doc}'s spans do not start with "
                                 "their placeholders")


__all__ = ["CPM2Dataset", "cpm2_prefixes", "is_cpm2_prefix"]
