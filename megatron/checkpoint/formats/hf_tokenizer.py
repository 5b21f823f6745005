"""The tokenizer files of a Hugging Face T5 folder (tokenizer.json with byte fallback, the
SentencePiece model, special tokens), built from our SentencePiece model for
megatron/checkpoint/formats/hf.py's `write_hf_folder`."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Dict, List, Tuple, Union

from megatron.data.tokenizers.tokenizer import SENTINEL_FORMAT, T5Tokenizer
from megatron.model.state_dict import StateDictError

PathLike = Union[str, os.PathLike]
SPIECE = "spiece.model"


class HFFolderError(StateDictError):
    """A Hugging Face folder that cannot be written or read; the message names the file and,
    where there is one, the tensor."""


def write_json(path: Path, values) -> None:
    path.write_text(json.dumps(values, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


TOKENIZER_CLASS = "PreTrainedTokenizerFast"
"""The class AutoTokenizer builds from tokenizer.json as it is. Not T5Tokenizer: transformers 5.x
rebuilds that one without byte fallback."""


class HFTokenizerFiles:
    """The tokenizer files of a folder, built (and checked) before anything is written."""

    def __init__(self, spm_model: Path, tokenizer, vocab_size: int, special: Dict[str, str],
                 sentinels: List[str], byte_fallback: bool = True,
                 user_defined: Tuple[Tuple[str, int], ...] = ()) -> None:
        self.spm_model, self.tokenizer, self.vocab_size = spm_model, tokenizer, vocab_size
        self.special, self.sentinels, self.byte_fallback = special, sentinels, byte_fallback
        self.user_defined = user_defined  # (piece, id): UL2's mode tokens, say

    def write(self, folder: Path) -> None:
        shutil.copyfile(self.spm_model, folder / SPIECE)
        self.tokenizer.save(str(folder / "tokenizer.json"))
        specials = {**self.special, "additional_special_tokens": self.sentinels}
        write_json(folder / "special_tokens_map.json", specials)
        write_json(folder / "tokenizer_config.json", {
            "tokenizer_class": TOKENIZER_CLASS, **specials,
            "extra_ids": len(self.sentinels), "clean_up_tokenization_spaces": False})
        (folder / "README.md").write_text(self.readme(), encoding="utf-8")

    def readme(self) -> str:
        """README.md of the folder: how to load the model and, above all, the tokenizer."""
        n, ids = len(self.sentinels), self.tokenizer.token_to_id
        pad, eos, unk = (self.special[k] for k in ("pad_token", "eos_token", "unk_token"))
        t5_tokenizer = (
            "Not `T5Tokenizer.from_pretrained` (nor `T5TokenizerFast`, the same class): "
            "transformers 5.x takes only the pieces and their scores from this folder and builds "
            "its own tokenizer **without byte fallback**. A character outside the vocabulary (a "
            "rare Chinese character, an emoji, another script) then becomes `<unk>` instead of "
            "the byte pieces `<0xNN>` of its UTF-8 bytes that the model was trained on, so such "
            "texts get other ids; texts whose characters are all in the vocabulary get the same "
            "ids from both." if self.byte_fallback else
            "This SentencePiece model has no byte fallback, so `T5Tokenizer.from_pretrained` "
            "(which transformers 5.x rebuilds without it) gives the same ids here.")
        return f"""# A T5 model in Hugging Face layout

Written by t5-pretrain's `data_tools/convert_checkpoint.py --to hf`.

```python
from transformers import AutoTokenizer, T5ForConditionalGeneration
tokenizer = AutoTokenizer.from_pretrained(FOLDER)
model = T5ForConditionalGeneration.from_pretrained(FOLDER)
```

## Tokenizer: load it with AutoTokenizer
`tokenizer.json` is the training run's SentencePiece model (`spiece.model`, also here) in the
`tokenizers` library's terms, byte fallback included. `AutoTokenizer.from_pretrained` loads it as
it is (`tokenizer_class: {TOKENIZER_CLASS}` in tokenizer_config.json and config.json) and
gives, for every text, the ids the model was trained on.

{t5_tokenizer}

`tokenizer.decode(ids)` writes special tokens (`<extra_id_0>`, `</s>`, `<pad>`) as text;
`skip_special_tokens=True` leaves them out.

## Special ids
`{pad}` = {ids(pad)} pads (and starts the decoder: generation_config.json), `{eos}` =
{ids(eos)} ends each text (the tokenizer appends it), `{unk}` = {ids(unk)}; sentinels: {
    f"`<extra_id_0>` = {self.vocab_size - 1} down to `<extra_id_{n - 1}>` = {self.vocab_size - n}"
    if n else "none"}.
{self._user_defined_section()}"""

    def _user_defined_section(self) -> str:
        if not self.user_defined:
            return ""
        listed = ", ".join(f"`{piece}` = {tid}" for piece, tid in self.user_defined)
        return (f"\nUser-defined symbols, one id each wherever they occur in a text (UL2's mode "
                f"tokens: `train_tokenizer.py --ul2-mode-tokens`): {listed}. The text "
                f"`[NLU] ...` is `▁` then `[NLU]`, as in SentencePiece.\n")


def hf_tokenizer_files(spm_model: PathLike, extra_ids: int = 100) -> HFTokenizerFiles:
    """tokenizer.json (a `tokenizers` Unigram model) and its configs for our SentencePiece model:
    transformers then encodes every text to the ids of `megatron.data.tokenizers.tokenizer.T5Tokenizer`
    (byte pieces for characters outside the vocabulary included) and decodes them back.

    Raises:
        HFFolderError: not a T5-layout SentencePiece model (see T5Tokenizer), or one whose
            settings tokenizer.json cannot reproduce (BPE, whitespace as suffix).
    """
    path = Path(spm_model)
    try:
        ours = T5Tokenizer(str(path), extra_ids)
        from sentencepiece import sentencepiece_model_pb2  # needs protobuf
    except ImportError as err:
        raise HFFolderError(f"writing tokenizer.json needs the protobuf package ({err})") \
            from None
    except ValueError as err:
        raise HFFolderError(str(err)) from None
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(path.read_bytes())
    trainer = proto.trainer_spec
    if trainer.model_type != trainer.UNIGRAM or trainer.treat_whitespace_as_suffix:
        kind = trainer.ModelType.Name(trainer.model_type).lower()
        if trainer.treat_whitespace_as_suffix:
            kind += " with whitespace as a suffix"
        raise HFFolderError(f"{path}: tokenizer.json is written for unigram SentencePiece models "
                            f"with whitespace as a prefix (T5's); this one is {kind}")
    sentinels = [SENTINEL_FORMAT.format(i) for i in range(extra_ids)]
    special = {"eos_token": ours.id_to_piece(ours.eos_id),
               "unk_token": ours.id_to_piece(ours.unk_id),
               "pad_token": ours.id_to_piece(ours.pad_id)}
    tokenizer = _unigram_tokenizer(proto, sentinels, list(special.values()), ours.unk_id,
                                   ours.eos_id)
    user_defined = tuple((p.piece, i) for i, p in enumerate(proto.pieces)
                         if p.type == type(proto).SentencePiece.USER_DEFINED)
    return HFTokenizerFiles(path, tokenizer, ours.vocab_size, special, sentinels,
                            trainer.byte_fallback, user_defined)


def _unigram_tokenizer(proto, sentinels: List[str], special: List[str], unk_id: int,
                       eos_id: int):
    """SentencePiece's pipeline in `tokenizers` terms: the model's precompiled normalization
    map, its whitespace rule (runs of spaces to one, none at the ends), `▁` for spaces with the
    dummy prefix, the pieces with their scores and byte fallback as the model has it. Byte,
    control and unused pieces are never matched in text by SentencePiece, so they get a score no
    segmentation picks (tokenizers would otherwise read the text "<0x41>" as a byte piece). The
    special pieces and the sentinels are special tokens, cut out of the text first; eos is
    appended as transformers' T5 tokenizer appends it. User-defined pieces (UL2's mode tokens)
    keep SentencePiece's score 0, above every normal piece, so the lattice takes each whole,
    after the dummy prefix `▁` as SentencePiece does; not added tokens, which would drop
    that `▁` and give other ids than training."""
    try:
        # tokenizers: an optional dependency (the 'convert' extra), needed only here
        from tokenizers import (
            AddedToken,
            Regex,
            Tokenizer,
            decoders,
            normalizers,
            pre_tokenizers,
            processors,
        )
        from tokenizers.models import Unigram
    except ImportError as err:
        raise HFFolderError(f"writing tokenizer.json needs the tokenizers package ({err})") \
            from None
    trainer, norm = proto.trainer_spec, proto.normalizer_spec
    piece_type = type(proto).SentencePiece
    scored = (piece_type.NORMAL, piece_type.UNKNOWN, piece_type.USER_DEFINED)
    normal = [p.score for p in proto.pieces if p.type == piece_type.NORMAL]
    never = min(normal, default=0.0) - 1000.0
    vocab = [(p.piece, p.score if p.type in scored else never) for p in proto.pieces]
    vocab += [(s, 0.0) for s in reversed(sentinels)]  # <extra_id_0> has the highest id
    tokenizer = Tokenizer(Unigram(vocab, unk_id=unk_id, byte_fallback=trainer.byte_fallback))
    steps = []
    if norm.precompiled_charsmap:
        steps.append(normalizers.Precompiled(norm.precompiled_charsmap))
    if norm.remove_extra_whitespaces:
        steps += [normalizers.Replace(Regex(" {2,}"), " "),
                  normalizers.Replace(Regex(r"\A +| +\z"), "")]
    if steps:
        tokenizer.normalizer = normalizers.Sequence(steps)
    metaspace = dict(replacement="\u2581", split=trainer.split_by_whitespace,
                     prepend_scheme="always" if norm.add_dummy_prefix else "never")
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(**metaspace)
    tokenizer.decoder = decoders.Sequence(
        [decoders.ByteFallback()] * trainer.byte_fallback + [decoders.Metaspace(**metaspace)])
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                  for t in special + sentinels])
    eos = proto.pieces[eos_id].piece
    tokenizer.post_processor = processors.TemplateProcessing(
        single=["$A", eos], pair=["$A", eos, "$B", eos], special_tokens=[(eos, eos_id)])
    return tokenizer
