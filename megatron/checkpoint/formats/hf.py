"""Hugging Face T5 folders, written from and read as a stream of full tensors under our names
(a Mixture-of-Experts model as a SwitchTransformers folder: switch.py).

    config.json                 T5Config.to_hf_dict plus the ids, dtype and tie transformers reads
    generation_config.json      decoder start, eos and pad ids
    model.safetensors           or model-0000K-of-0000N.safetensors + model.safetensors.index.json
    spiece.model                the SentencePiece model (with a tokenizer model)
    tokenizer.json              the same ids as megatron.data.tokenizers.tokenizer.T5Tokenizer (below)
    tokenizer_config.json, special_tokens_map.json
    README.md                   how to load it: AutoTokenizer, not T5Tokenizer (below); for an
                                untied model, why transformers 5.x warns as it loads it

Memory is bounded by one tensor when writing (megatron.checkpoint.formats.shards writes each tensor's
bytes to its file as it comes, never a whole shard) and by two vocabulary-sized tensors when
reading.
A folder is written to OUT.tmp and renamed into place, so a failure leaves nothing behind.

What transformers 5.x does that shapes this module:
- Its T5Config forces `tie_word_embeddings` to true whatever config.json says (the old value only
  sets `scale_decoder_outputs`) and its from_pretrained decides the tie from the tensors: an
  `lm_head.weight` that is present and differs from `shared.weight` stays untied. save_pretrained
  writes `shared.weight` alone for a tied model and `shared.weight` + `lm_head.weight` for an
  untied one, never the `embed_tokens` copies; so do we. Loading an untied model therefore
  always logs "... both are present in the checkpoints with different values, so we will NOT tie
  them" (its own saves too; passing `tie_word_embeddings=False` to from_pretrained instead leaves
  the encoder and decoder embeddings untied and missing). We write `tie_word_embeddings: false`
  for an untied model, which transformers 4.x needs to untie and to leave the outputs unscaled,
  and the folder's README.md says why the warning is expected.
- Its T5Tokenizer (= T5TokenizerFast) takes the pieces, scores and character map of tokenizer.json
  (else spiece.model) and builds its own Unigram model with `byte_fallback=False`
  (TokenizersBackend.convert_to_native_format, models/t5/tokenization_t5.py): characters outside
  the vocabulary become `<unk>`, not byte pieces. `tokenizer_class: PreTrainedTokenizerFast` in
  tokenizer_config.json and config.json (AutoTokenizer reads the first, else the second) makes
  AutoTokenizer load tokenizer.json as it is; the folder's README.md tells its users.
- It writes no pytorch_model.bin any more (`safe_serialization` is ignored) but still reads it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Tuple, Union

import torch
from safetensors import safe_open

from megatron.checkpoint.formats.hf_tokenizer import (
    TOKENIZER_CLASS,
    HFFolderError,
    HFTokenizerFiles,
    PathLike,
    hf_tokenizer_files,
    write_json,
)
from megatron.checkpoint.formats.shards import ShardWriter
from megatron.model.config import T5Config
from megatron.model.prompt import PROMPT_PARAMETER
from megatron.checkpoint.formats.switch import (
    ARCHITECTURE as SWITCH_ARCHITECTURE,
    export_problems,
    switch_config_dict,
    switch_config_values,
    switch_readme,
    switch_tensors,
)
from megatron.model.meta import buffer_shapes, full_parameter_shapes
from megatron.model.state_dict import (
    HF_IGNORED,
    hf_copies,
    hf_copy_problem,
    hf_embedding_source,
    resolve_hf_tie,
    stack_switch_experts,
    switch_shapes,
)

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
SAFE_SINGLE, SAFE_INDEX = "model.safetensors", "model.safetensors.index.json"
BIN_SINGLE, BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}

# Keys of transformers' generic PretrainedConfig that older versions wrote into every config.json
# (generation defaults, output switches, label maps): none changes the weights.
GENERIC_HF_KEYS = frozenset({
    "return_dict", "output_hidden_states", "output_attentions", "torchscript", "torch_dtype",
    "use_bfloat16", "tf_legacy_loss", "chunk_size_feed_forward", "cross_attention_hidden_size",
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens", "finetuning_task", "prefix", "sep_token_id",
    "_commit_hash", "_attn_implementation_autoset", "_attn_implementation", "xla_device",
    "label_smoothing", "chunk_size", "is_composition", "attn_implementation",
})
# Generic keys that would change the model if set: accepted at these values only.
GENERIC_HF_OFF = {"pruned_heads": {}, "tie_encoder_decoder": False, "add_cross_attention": False}


@contextlib.contextmanager
def staged_folder(out: Path) -> Iterator[Path]:
    """OUT.tmp to write into: on success it replaces OUT, on any failure it is removed, so
    nothing half-written is left."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def parse_size(value: Union[int, str]) -> int:
    """Bytes of `value`: an int, or '5GB', '500MB', '50KB' (powers of 10, as transformers) or
    '2GiB', '10MiB' (powers of 2)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    units = {"kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40, "kb": 10 ** 3,
             "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12, "b": 1}
    text = str(value).strip().lower()
    unit = next((u for u in units if text.endswith(u)), "")
    try:
        size = int(float(text[:len(text) - len(unit)]) * units.get(unit, 1))
    except ValueError:
        size = 0
    if size <= 0:
        raise HFFolderError(f"max_shard_size {value!r} is not a size such as '5GB' or 2000000")
    return size


# Writing ----------------------------------------------------------------------------------------

def write_hf_folder(out_dir: PathLike, config: T5Config,
                    tensors: Iterable[Tuple[str, torch.Tensor]],
                    max_shard_size: Union[int, str] = "5GB",
                    tokenizer_model: Optional[PathLike] = None,
                    dtype: Optional[Union[torch.dtype, str]] = None, extra_ids: int = 100,
                    force: bool = False,
                    progress: Optional[Callable[[str], None]] = None,
                    tokenizer_files=None, allow_inexact: bool = False) -> Path:
    """Write a folder that `T5ForConditionalGeneration.from_pretrained` (and AutoTokenizer, with
    a tokenizer model) loads as the model the tensors describe; for a Mixture-of-Experts config,
    `SwitchTransformersForConditionalGeneration.from_pretrained` (switch.py).

    Args:
        out_dir: the folder to create.
        config: the architecture (`tie_word_embeddings` says whether `lm_head.weight` comes).
        tensors: (name, full unpadded tensor) pairs under our names, one at a time, each name of
            the model once (`full_parameter_shapes(config)`); any order.
        max_shard_size: weight files above this are split (transformers' rule: a tensor starts a
            new file when it would take the current one over the size).
        tokenizer_model: our SentencePiece model; adds spiece.model and the tokenizer files.
        dtype: cast floating tensors to it (torch dtype or its name); None keeps theirs.
        extra_ids: the tokenizer's sentinels (`<extra_id_N>`), as in T5Tokenizer.
        force: replace an existing `out_dir`.
        progress: called with each tensor's name once it is taken.
        tokenizer_files: instead of tokenizer_model, a tokenizer of another kind: an object
            with `vocab_size` and `write(folder)` (megatron.checkpoint.formats.cpm2.CPM2TokenizerFiles).
        allow_inexact: write a Mixture-of-Experts model that transformers would compute
            differently (`switch.export_problems`), the differences listed in its README.md.

    Raises:
        HFFolderError: `out_dir` exists without `force`, a name that is not the model's, given
            twice or missing, a shape that does not fit, a tokenizer model that cannot be
            converted, or a Mixture-of-Experts model SwitchTransformers cannot hold (or not
            exactly, without `allow_inexact`) (all before anything is left behind).
    """
    out = Path(out_dir)
    if out.exists() and not force:
        raise HFFolderError(f"{out} exists; pass force=True (--force) to replace it")
    inexact = _check_switch(config, allow_inexact) if config.is_moe else []
    dtype = _torch_dtype(dtype)
    tokenizer = tokenizer_files
    if tokenizer_model is not None:  # checked before the weights stream in
        tokenizer = hf_tokenizer_files(tokenizer_model, extra_ids)
        if tokenizer.vocab_size > config.vocab_size:
            raise HFFolderError(f"{tokenizer_model}: {tokenizer.vocab_size} token ids (with "
                                f"{extra_ids} sentinels) do not fit the model's vocab_size "
                                f"{config.vocab_size}")
    with staged_folder(out) as tmp:
        expected = {**full_parameter_shapes(config), **buffer_shapes(config)}
        writer = ShardWriter(tmp, parse_size(max_shard_size))
        seen = set()
        first_dtype = None
        for name, tensor in tensors:
            if name not in expected:
                extra = " (the config ties the head to shared.weight)" \
                    if name == "lm_head.weight" else ""
                if name == PROMPT_PARAMETER:
                    extra = (" (a --prompt-train-model checkpoint's tuned prompt: a Hugging "
                             "Face T5 has no place for it; decode with python -m "
                             "megatron.generate --load CKPT instead)")
                raise HFFolderError(f"{out}: tensor {name} is not a parameter of this model"
                                    f"{extra}")
            if name in seen:
                raise HFFolderError(f"{out}: tensor {name} given twice")
            if tuple(tensor.shape) != expected[name]:
                raise HFFolderError(f"{out}: tensor {name} has shape {tuple(tensor.shape)}, the "
                                    f"config needs {expected[name]}")
            seen.add(name)
            tensor = tensor.detach().to("cpu")
            if dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(dtype)
            if first_dtype is None and tensor.is_floating_point():
                first_dtype = tensor.dtype
            for hf_name, part in (switch_tensors([(name, tensor)], config) if config.is_moe
                                  else [(name, tensor)]):
                writer.add(hf_name, part)
            if progress is not None:
                progress(name)
        missing = [n for n in expected if n not in seen]
        if missing:
            raise HFFolderError(f"{out}: {len(missing)} tensor(s) of the model not given: "
                                f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
        writer.close()
        values = switch_config_dict(config, _dtype_name(first_dtype)) if config.is_moe \
            else hf_config_dict(config, first_dtype)
        if isinstance(tokenizer, HFTokenizerFiles):  # AutoTokenizer reads it without
            values["tokenizer_class"] = TOKENIZER_CLASS  # tokenizer_config.json's
        write_json(tmp / CONFIG, values)
        write_json(tmp / GENERATION_CONFIG, {
            "decoder_start_token_id": config.decoder_start_token_id,
            "eos_token_id": config.eos_token_id, "pad_token_id": config.pad_token_id})
        if tokenizer is not None:
            tokenizer.write(tmp)
        if config.is_moe:
            _switch_readme(tmp / "README.md", config, inexact)
        elif not config.tie_word_embeddings:
            _untied_readme(tmp / "README.md")
    return out


UNTIED_README = """## The warning when loading

transformers 5.x logs, when it loads this model:

    The tied weights mapping and config for this model specifies to tie shared.weight to
    lm_head.weight, but both are present in the checkpoints with different values, so we will
    NOT tie them. You should update the config with `tie_word_embeddings=False` to silence this
    warning.

The model is loaded correctly: it has an output layer of its own (`lm_head.weight`, as T5 v1.1,
mT5 and CPM-2 do), and transformers leaves it untied, as it must. config.json already says
`tie_word_embeddings: false`, but transformers 5.x's `T5Config` sets it to true whatever
config.json says (the saved value only decides `scale_decoder_outputs`), so every untied T5
logs this warning, the folders transformers' own `save_pretrained` writes included. No
config.json silences it: `tie_word_embeddings: false` is what transformers 4.x needs to keep
the head untied and the decoder output unscaled, and `from_pretrained(...,
tie_word_embeddings=False)` would leave the encoder's and decoder's embeddings untied and
missing.
"""


def _untied_readme(path: Path) -> None:
    """The tokenizer's README.md (if any) with why transformers warns about the untied head."""
    text = path.read_text(encoding="utf-8") if path.is_file() else \
        "# A T5 model in Hugging Face layout\n\nWritten by t5-pretrain's " \
        "`data_tools/convert_checkpoint.py --to hf`.\n"
    path.write_text(text.rstrip("\n") + "\n\n" + UNTIED_README, encoding="utf-8")


def _check_switch(config: T5Config, allow_inexact: bool) -> List[str]:
    """What transformers would compute differently (empty: nothing); raises HFFolderError for
    what it cannot hold, and for those differences unless `allow_inexact`."""
    never, inexact = export_problems(config)
    if never:
        raise HFFolderError("a SwitchTransformers folder cannot hold this Mixture-of-Experts "
                            "model: " + "; ".join(never) + " (--to fp32 writes its tensors "
                            "under our names)")
    if inexact and not allow_inexact:
        raise HFFolderError("transformers' SwitchTransformers would compute another model "
                            "than this one: " + "; ".join(inexact) + ". Pass --allow-inexact-hf "
                            "(allow_inexact) to write it anyway: its README.md then lists the "
                            "differences, and --from hf reads the exact model back")
    return inexact


def _switch_readme(path: Path, config: T5Config, inexact: List[str]) -> None:
    """The tokenizer's README.md (if any) for SwitchTransformers, with the experts' section."""
    text = path.read_text(encoding="utf-8") if path.is_file() else \
        f"# {SWITCH_ARCHITECTURE}\n"
    text = text.replace("T5ForConditionalGeneration", SWITCH_ARCHITECTURE)
    path.write_text(text.rstrip("\n") + "\n\n" + switch_readme(config, inexact),
                    encoding="utf-8")


def _dtype_name(dtype: Optional[torch.dtype]) -> Optional[str]:
    return None if dtype is None else DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def hf_config_dict(config: T5Config, dtype: Optional[torch.dtype] = None) -> Dict:
    """config.json for `config`: what transformers 4.x and 5.x read (the tie as 4.x reads it,
    `scale_decoder_outputs` as 5.x does, the activation keys both write) and our own
    T5Config.from_json reads back unchanged."""
    values = config.to_hf_dict()
    values.update(dense_act_fn=config.activation, is_gated_act=config.is_gated_act,
                  use_cache=True)
    if dtype is not None:  # "dtype" for transformers 5.x, "torch_dtype" for 4.x
        values["dtype"] = values["torch_dtype"] = DTYPE_NAMES.get(
            dtype, str(dtype).removeprefix("torch."))
    return dict(sorted(values.items()))


def _torch_dtype(dtype) -> Optional[torch.dtype]:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    names = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
             **{name: d for d, name in DTYPE_NAMES.items()}}
    if dtype not in names:
        raise HFFolderError(f"dtype {dtype!r} is not one of {', '.join(names)}")
    return names[dtype]


# Reading ----------------------------------------------------------------------------------------

def read_hf_config(path: PathLike) -> T5Config:
    """Our config from a T5 / mT5 config.json written by any transformers version.

    Raises:
        HFFolderError: no such file, not JSON, not a T5 model, or a generic switch that would
            change the model (pruned heads, encoder tied to decoder).
        ConfigError: T5 values that cannot be built (T5Config.from_dict).
    """
    path = Path(path)
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise HFFolderError(f"{path}: cannot read the model config ({err.strerror})") from None
    except ValueError as err:
        raise HFFolderError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(values, dict):
        raise HFFolderError(f"{path}: expected a JSON object")
    model_type = values.get("model_type", "t5")
    if model_type not in ("t5", "mt5", "switch_transformers"):
        raise HFFolderError(f"{path}: model_type {model_type!r} is not T5: only T5, mT5 and "
                            f"SwitchTransformers (T5ForConditionalGeneration, "
                            f"MT5ForConditionalGeneration, "
                            f"SwitchTransformersForConditionalGeneration) folders are read")
    problems = [f"{key} {values[key]!r} is not supported (only {off!r})"
                for key, off in GENERIC_HF_OFF.items() if values.get(key, off) not in (off, None)]
    if problems:
        raise HFFolderError(f"{path}: " + "; ".join(problems))
    kept = {k: v for k, v in values.items() if k not in GENERIC_HF_KEYS and k not in GENERIC_HF_OFF}
    if model_type == "switch_transformers":
        kept = switch_config_values(kept)
    if model_type == "mt5":
        # MT5ForConditionalGeneration never scales the decoder output (transformers 5.x; 4.x
        # scaled when tied, and released mT5 models are untied), though 5.x writes
        # tie_word_embeddings true into every mT5 config.json.
        kept["scale_decoder_outputs"] = False
    return T5Config.from_dict(kept, source=str(path))


def read_hf_folder(directory: PathLike) -> Tuple[T5Config, Iterator[Tuple[str, torch.Tensor]]]:
    """(our config, an iterator of (our name, full tensor)) of a Hugging Face T5 folder written by
    any transformers version: model.safetensors, pytorch_model.bin, or either sharded with its
    index. The model is the one transformers' from_pretrained builds: the head is untied exactly
    when an `lm_head.weight` is present and differs from the embedding; the tied copies
    (`encoder/decoder.embed_tokens.weight`, a tied `lm_head.weight`) are dropped when equal to
    the embedding, `HF_IGNORED` always. Every name, shape and copy is checked before the first
    tensor comes; then the tensors come one at a time, file by file.

    Raises:
        HFFolderError: no weights, an unreadable or truncated file, an index that does not
            match its shards, names the model lacks or does not have, shapes that differ, a copy
            that differs from the embedding, or a model that is not T5 (the file and tensor
            named).
        ConfigError: config.json values that cannot be built.
    """
    directory = Path(directory)
    config = read_hf_config(directory / CONFIG)
    files = _weight_files(directory)
    shapes = {}  # hf name -> (file, shape)
    for file, names in files.items():
        with _WeightFile(file) as tensors:
            for name in tensors.names():
                if names is not None and name not in names:
                    raise HFFolderError(f"{file}: holds {name}, which its index does not list")
                shapes[name] = (file, tensors.shape(name))
            lacking = sorted((names or set()) - set(tensors.names()))
            if lacking:
                raise HFFolderError(f"{file}: lacks {lacking[0]}, which the index places there")

    def load(name):
        with _WeightFile(shapes[name][0]) as tensors:
            return tensors.get(name)

    head = load("lm_head.weight") if "lm_head.weight" in shapes else None
    source = hf_embedding_source(shapes)
    embedding = load(source) if source is not None else None
    config = resolve_hf_tie(config, head, embedding)
    del head
    copies = hf_copies(config)
    source = hf_embedding_source(shapes, copies)
    indexed = any(names is not None for names in files.values())
    _check_names(directory, config, shapes, source, copies, indexed)
    problems = []
    for name in copies:  # one vocabulary-sized tensor at a time beside the embedding
        if name in shapes and name != source:
            problem = hf_copy_problem(name, load(name), embedding)
            if problem:
                problems.append(f"{shapes[name][0].name}: {problem}")
    del embedding
    if problems:
        raise HFFolderError(f"{directory}: " + "; ".join(problems))
    dropped = set(copies) - {source} | set(HF_IGNORED)
    stream = _stream(files, dropped, source)
    return config, (stack_switch_experts(stream, config) if config.is_moe else stream)


def _check_names(directory, config, shapes, source, copies, indexed) -> None:
    expected = full_parameter_shapes(config)
    if config.is_moe:  # SwitchTransformers names: one tensor per expert, dense blocks' `mlp`
        expected = {**switch_shapes(expected, config), **buffer_shapes(config)}
    ours = {("shared.weight" if n == source else n): n for n in shapes
            if n not in HF_IGNORED and (n == source or n not in copies)}
    problems = []
    missing = [n for n in expected if n not in ours]
    if missing:
        where = "the index lists" if indexed else "the weights hold"
        problems.append(f"{len(missing)} tensor(s) of the model missing ({where} none of "
                        f"them): {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    for name, hf_name in ours.items():
        file, shape = shapes[hf_name]
        if name not in expected:
            problems.append(f"{file.name}: {hf_name} is not a parameter of this T5 model")
        elif shape != expected[name]:
            problems.append(f"{file.name}: {hf_name} has shape {shape}, config.json needs "
                            f"{expected[name]}")
    if problems:
        raise HFFolderError(f"{directory}: " + "; ".join(problems))


def _stream(files: Dict[Path, Optional[set]], dropped: set, source: Optional[str]):
    for file in files:
        with _WeightFile(file) as tensors:
            for name in tensors.names():
                if name in dropped:
                    continue
                yield ("shared.weight" if name == source else name), tensors.get(name)


def _weight_files(directory: Path) -> Dict[Path, Optional[set]]:
    """Weight file -> the names its index places there (None without an index), in the order
    transformers prefers them."""
    if (directory / SAFE_SINGLE).is_file():
        return {directory / SAFE_SINGLE: None}
    for index in (SAFE_INDEX, BIN_INDEX):
        path = directory / index
        if path.is_file():
            try:
                weight_map = json.loads(path.read_text(encoding="utf-8"))["weight_map"]
                assert isinstance(weight_map, dict)
            except (OSError, ValueError, KeyError, TypeError, AssertionError) as err:
                raise HFFolderError(f"{path}: not a weights index with a weight_map "
                                    f"({err!r})") from None
            files: Dict[Path, set] = {}
            for name, file in weight_map.items():
                shard = directory / file
                if not shard.is_file():
                    raise HFFolderError(f"{path}: places {name} in {file}, which is missing")
                files.setdefault(shard, set()).add(name)
            return dict(sorted(files.items()))
    if (directory / BIN_SINGLE).is_file():
        return {directory / BIN_SINGLE: None}
    raise HFFolderError(f"{directory}: no {SAFE_SINGLE}, {SAFE_INDEX}, {BIN_SINGLE} or "
                        f"{BIN_INDEX}")


class _WeightFile:
    """One weight file, opened lazily: safetensors through safe_open, pytorch_model.bin through
    torch.load with mmap (a file too old for mmap is loaded whole)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self):
        try:
            if self.path.suffix == ".safetensors":
                self.handle = safe_open(str(self.path), framework="pt", device="cpu")
                self.file, self.dict = self.handle.__enter__(), None
            else:
                self.handle = None
                self.dict = _torch_load(self.path)
        except Exception as err:  # safetensors, zip, pickle and OS errors alike
            raise HFFolderError(f"{self.path}: cannot read the weights (truncated or not a "
                                f"weights file?): {err}") from None
        return self

    def __exit__(self, *exc) -> None:
        if self.handle is not None:
            self.handle.__exit__(*exc)
        self.dict = None

    def names(self) -> List[str]:
        return list(self.dict) if self.dict is not None else list(self.file.keys())

    def shape(self, name: str) -> Tuple[int, ...]:
        if self.dict is not None:
            return tuple(self.dict[name].shape)
        return tuple(self.file.get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        try:
            return self.dict[name] if self.dict is not None else self.file.get_tensor(name)
        except Exception as err:
            raise HFFolderError(f"{self.path}: cannot read tensor {name}: {err}") from None


def _torch_load(path: Path) -> Dict[str, torch.Tensor]:
    try:
        loaded = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except RuntimeError as err:
        if "mmap can only be used" not in str(err):
            raise
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(loaded, dict) or not all(isinstance(t, torch.Tensor)
                                               for t in loaded.values()):
        raise ValueError("not a state dict of tensors")
    return loaded


def read_hf_checkpoint(directory: PathLike) -> Tuple[T5Config, Dict[str, torch.Tensor]]:
    """(our config, our full state dict) of a Hugging Face T5 folder, as Hugging Face's
    `from_pretrained` would build the model: the whole of `read_hf_folder` in one dict (use
    that function to stream the tensors one at a time instead).

    Raises:
        ConfigError: config.json missing or invalid.
        HFFolderError: no weights file, unreadable files, or tensors the model would not use.
    """
    config, tensors = read_hf_folder(directory)
    return config, dict(tensors)
