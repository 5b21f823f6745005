"""Hugging Face folders through transformers itself (megatron/checkpoint/formats/hf.py): our weights
written as a folder that T5ForConditionalGeneration.from_pretrained loads as the same model (tied
and untied, sharded or not, no missing or unexpected keys, no warning but the one transformers
gives every untied T5), its own save_pretrained folders (and pytorch_model.bin ones, and the
config.json files older versions published) read back as the model it builds, our -> HF -> our
bit for bit, the tokenizer giving our tokenizer's ids, and bad folders refused by name."""

import contextlib
import json
import logging
import shutil
import warnings

import pytest
import safetensors.torch
import torch
from huggingface_hub import save_torch_state_dict
from transformers import AutoTokenizer, MT5Config, MT5ForConditionalGeneration
from transformers import T5Config as HFConfig
from transformers import T5ForConditionalGeneration, T5Tokenizer

from megatron.checkpoint.formats.hf import (
    HFFolderError,
    read_hf_checkpoint,
    read_hf_folder,
    write_hf_folder,
)
from megatron.data.tokenizers.tokenizer import T5Tokenizer as OurTokenizer
from megatron.model import T5Config, T5Model
from megatron.model.meta import full_parameter_shapes
from megatron.model.state_dict import (
    HF_IGNORED,
    StateDictError,
    gather_full_state_dict,
    load_full_state_dict,
)

VOCAB = 4100  # the session tokenizer's ids: 4000 pieces + 100 sentinels (tests/conftest.py)
CONFIGS = {
    "v1_0": dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                 feed_forward_proj="relu", tie_word_embeddings=True, dropout_rate=0.0),
    "v1_1": dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2,
                 num_decoder_layers=3, num_heads=4, feed_forward_proj="gated-gelu",
                 tie_word_embeddings=False, dropout_rate=0.0),
}
UNTIE_WARNING = "both are present in the checkpoints with different values, so we will NOT tie"


def spread(module, seed):
    """Every weight scaled by its own random factor (the norms off 1.0), so a wrong mapping
    shows in the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.mul_(torch.empty(param.shape).uniform_(0.5, 1.5, generator=g))
    return module


def our_model(name, seed=0):
    torch.manual_seed(seed)
    return spread(T5Model(T5Config(**CONFIGS[name])), seed).eval()  # vocabulary padded to 4224


def hf_model(fields, seed=0, cls=T5ForConditionalGeneration, config_cls=HFConfig):
    """transformers 5.x ties lm_head on construction: an untied config gets its own head."""
    torch.manual_seed(seed)
    hf = cls(config_cls(**fields))
    if not fields["tie_word_embeddings"]:
        hf.lm_head.weight = torch.nn.Parameter(torch.randn_like(hf.lm_head.weight))
    return spread(hf, seed).eval()


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    enc = torch.randint(2, VOCAB, (3, 12), generator=g)
    dec = torch.randint(2, VOCAB, (3, 7), generator=g)
    labels = torch.randint(2, VOCAB, (3, 7), generator=g)
    enc_mask = torch.ones(3, 12, dtype=torch.long)
    enc_mask[1, 7:] = 0
    dec_mask = torch.ones(3, 7, dtype=torch.long)
    dec_mask[2, 4:] = 0
    labels[2, 4:] = -100
    return enc, dec, enc_mask, dec_mask, labels


def assert_same_logits(ours, hf):
    enc, dec, enc_mask, dec_mask, labels = batch()
    with torch.no_grad():
        ref = hf(input_ids=enc, attention_mask=enc_mask, decoder_input_ids=dec,
                 decoder_attention_mask=dec_mask, labels=labels)
        out = ours(enc, dec, enc_mask, dec_mask, labels)
    torch.testing.assert_close(out.logits[..., :VOCAB], ref.logits, rtol=1e-5,
                               atol=1e-5 * ref.logits.abs().max().item())
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=0)


@contextlib.contextmanager
def transformers_warnings():
    """Warnings transformers logs or raises inside the block (the list fills on exit)."""
    messages = []

    class Collect(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    handler = Collect(level=logging.WARNING)
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield messages
    finally:
        logger.removeHandler(handler)
    messages += [str(w.message) for w in caught]


def from_pretrained(path, cls=T5ForConditionalGeneration):
    """(model, loading info, warnings) as transformers loads the folder."""
    with transformers_warnings() as messages:
        model, info = cls.from_pretrained(path, attn_implementation="eager",
                                          output_loading_info=True)
    return model.eval(), info, messages


def test_full_parameter_shapes_are_the_models():
    for fields in CONFIGS.values():
        config = T5Config(**fields)
        model = T5Model(config, make_vocab_size_divisible_by=1, device="meta")
        assert list(full_parameter_shapes(config).items()) == \
            [(n, tuple(p.shape)) for n, p in model.named_parameters()]


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_our_weights_load_in_transformers(name, sharded, tmp_path):
    """Full tensors streamed from our model (padded vocabulary removed) -> write_hf_folder ->
    from_pretrained: the same logits and loss, no missing or unexpected keys; tied, no warning at
    all; untied, only the one transformers logs for its own untied saves as well."""
    ours = our_model(name, seed=1)
    tied = CONFIGS[name]["tie_word_embeddings"]
    full = gather_full_state_dict(ours)
    taken = []

    def stream():  # shards reach the disk while the tensors still come
        for i, item in enumerate(full.items()):
            if sharded and i == len(full) - 1:
                assert list((tmp_path / "hf.tmp").glob("*.partial"))
            yield item

    out = write_hf_folder(tmp_path / "hf", ours.config, stream(),
                          max_shard_size="100KB" if sharded else "5GB", progress=taken.append)
    assert taken == list(full_parameter_shapes(ours.config)) and not (tmp_path / "hf.tmp").exists()
    files = sorted(p.name for p in out.iterdir())
    if sharded:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        shards = sorted(set(index["weight_map"].values()))
        assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
        assert set(index["weight_map"]) == set(full_parameter_shapes(ours.config))
        for shard in shards:  # a shard goes above the size only when one tensor does
            tensors = safetensors.torch.load_file(out / shard)
            size = sum(t.numel() * t.element_size() for t in tensors.values())
            assert size <= 100_000 or len(tensors) == 1
    else:
        assert files == sorted(["config.json", "generation_config.json", "model.safetensors"] +
                               ([] if tied else ["README.md"]))
    written = json.loads((out / "config.json").read_text())
    assert written["tie_word_embeddings"] == tied and written["scale_decoder_outputs"] == tied
    assert written["dtype"] == "float32" and written["decoder_start_token_id"] == 0

    hf, info, messages = from_pretrained(out)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert (hf.lm_head.weight is hf.shared.weight) == tied
    assert hf.generation_config.decoder_start_token_id == 0
    if tied:
        assert messages == []
    else:
        assert len(messages) == 1 and UNTIE_WARNING in messages[0]
        # the export's README says why (no config.json silences it)
        readme = " ".join((out / "README.md").read_text().split())
        assert "The model is loaded correctly" in readme and UNTIE_WARNING in readme
        hf.save_pretrained(tmp_path / "theirs")  # transformers' own save warns the same
        assert from_pretrained(tmp_path / "theirs")[2] == messages
    assert_same_logits(ours, hf)


def save_bin(hf, folder, max_shard_size="5GB"):
    """pytorch_model.bin as transformers 4.x wrote it (5.x writes safetensors only): the whole
    state dict, tied copies included, through huggingface_hub's writer, sharded above the size."""
    folder.mkdir()
    save_torch_state_dict(hf.state_dict(), folder, safe_serialization=False,
                          max_shard_size=max_shard_size)
    hf.config.save_pretrained(folder)


FORMATS = {
    "safetensors": lambda hf, folder: hf.save_pretrained(folder),
    "safetensors_sharded": lambda hf, folder: hf.save_pretrained(folder, max_shard_size="60KB"),
    "bin": save_bin,
    "bin_sharded": lambda hf, folder: save_bin(hf, folder, max_shard_size="60KB"),
}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_transformers_folders_read_as_from_pretrained_builds_them(name, fmt, tmp_path):
    hf = hf_model(CONFIGS[name], seed=2)
    FORMATS[fmt](hf, tmp_path / "hf")
    if fmt.endswith("sharded"):
        assert len(list((tmp_path / "hf").glob("*-of-*"))) > 2
    ref, info, _ = from_pretrained(tmp_path / "hf")
    assert not info["missing_keys"] and not info["unexpected_keys"]

    config, tensors = read_hf_folder(tmp_path / "hf")
    assert config.tie_word_embeddings == CONFIGS[name]["tie_word_embeddings"]
    names = []
    ours = T5Model(config).eval()
    full = {}
    for tensor_name, tensor in tensors:  # one at a time
        names.append(tensor_name)
        full[tensor_name] = tensor
    assert sorted(names) == sorted(n for n, _ in ours.named_parameters())
    load_full_state_dict(ours, full)
    assert_same_logits(ours, ref)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_ours_to_hf_to_ours_is_bit_exact(name, dtype, tmp_path):
    ours = our_model(name, seed=3)
    full = gather_full_state_dict(ours)
    write_hf_folder(tmp_path / "hf", ours.config, full.items(), max_shard_size="50KB",
                    dtype=dtype)
    config, tensors = read_hf_folder(tmp_path / "hf")
    assert config == ours.config
    back = dict(tensors)
    assert set(back) == set(full)
    for key, tensor in full.items():
        expected = tensor if dtype is None else tensor.to(dtype)
        assert back[key].dtype == expected.dtype and torch.equal(back[key], expected), key
    assert read_hf_checkpoint(tmp_path / "hf")[0] == config  # the dict form reads the same
    if dtype is not None:
        assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"


# config.json as the released checkpoints publish it (t5-small from 2020, google/t5-v1_1-*,
# google/mt5-*, google/flan-t5-*), at tiny sizes.
TINY = dict(d_ff=64, d_kv=8, d_model=32, num_heads=4, num_layers=2, vocab_size=VOCAB,
            dropout_rate=0.1, decoder_start_token_id=0, eos_token_id=1, pad_token_id=0,
            initializer_factor=1.0, is_encoder_decoder=True, layer_norm_epsilon=1e-06,
            relative_attention_num_buckets=32)
RELEASED = {
    "t5_2020": dict(TINY, architectures=["T5WithLMHeadModel"], model_type="t5", n_positions=512,
                    output_past=True, task_specific_params={
                        "summarization": {"early_stopping": True, "length_penalty": 2.0,
                                          "max_length": 200, "prefix": "summarize: "}}),
    "t5_v1_1": dict(TINY, architectures=["T5ForConditionalGeneration"], model_type="t5",
                    feed_forward_proj="gated-gelu", num_decoder_layers=2, output_past=True,
                    tie_word_embeddings=False),
    "mt5": dict(TINY, _name_or_path="/home/user/mt5-small", model_type="mt5",
                architectures=["MT5ForConditionalGeneration"], feed_forward_proj="gated-gelu",
                num_decoder_layers=2, tie_word_embeddings=False, tokenizer_class="T5Tokenizer",
                transformers_version="4.10.0.dev0", use_cache=True),
    "flan_t5": dict(TINY, architectures=["T5ForConditionalGeneration"], model_type="t5",
                    dense_act_fn="gelu_new", feed_forward_proj="gated-gelu", is_gated_act=True,
                    n_positions=512, num_decoder_layers=2, output_past=True,
                    relative_attention_max_distance=128, tie_word_embeddings=False,
                    torch_dtype="float32", transformers_version="4.23.1", use_cache=True),
}


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_released_config_files_read_as_from_pretrained_builds_them(name, tmp_path):
    """The released config.json files, with the tensors their pytorch_model.bin held (tied copies
    and, in some, the unused cross-attention bias), load as transformers loads them."""
    values = RELEASED[name]
    mt5 = values["model_type"] == "mt5"
    fields = {k: values[k] for k in TINY if k != "dropout_rate"} | {
        "dropout_rate": 0.0, "tie_word_embeddings": values.get("tie_word_embeddings", True),
        "feed_forward_proj": values.get("feed_forward_proj", "relu")}
    hf = hf_model(fields, seed=4, cls=MT5ForConditionalGeneration if mt5 else
                  T5ForConditionalGeneration, config_cls=MT5Config if mt5 else HFConfig)
    state = dict(hf.state_dict())
    state[HF_IGNORED[0]] = torch.randn(32, 4)
    folder = tmp_path / "hf"
    folder.mkdir()
    torch.save(state, folder / "pytorch_model.bin")
    (folder / "config.json").write_text(json.dumps(values))
    ref, info, _ = from_pretrained(folder, MT5ForConditionalGeneration if mt5 else
                                   T5ForConditionalGeneration)
    assert not info["missing_keys"]

    config, tensors = read_hf_folder(folder)
    ours = T5Model(config).eval()
    load_full_state_dict(ours, dict(tensors))
    assert_same_logits(ours, ref)


def test_mt5_saved_by_transformers_5_is_unscaled(tmp_path):
    """transformers 5.x writes tie_word_embeddings true into every mT5 config.json (and no
    scale_decoder_outputs); its MT5ForConditionalGeneration never scales the decoder output."""
    fields = dict(CONFIGS["v1_1"], num_decoder_layers=2)
    hf = hf_model(fields, seed=7, cls=MT5ForConditionalGeneration, config_cls=MT5Config)
    hf.save_pretrained(tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["tie_word_embeddings"]
    config, tensors = read_hf_folder(tmp_path / "hf")
    assert not config.tie_word_embeddings and not config.scale_decoder_outputs
    ours = T5Model(config).eval()
    load_full_state_dict(ours, dict(tensors))
    assert_same_logits(ours, from_pretrained(tmp_path / "hf", MT5ForConditionalGeneration)[0])


def test_a_full_config_dump_of_generic_keys_is_read(tmp_path):
    """Older transformers wrote every generic PretrainedConfig key (generation defaults, output
    switches) into config.json: to_dict() still lists them."""
    hf = hf_model(CONFIGS["v1_1"], seed=5)
    hf.save_pretrained(tmp_path / "hf")
    dump = hf.config.to_dict()
    assert {"output_hidden_states", "return_dict"} <= set(dump)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(dump))
    config, tensors = read_hf_folder(tmp_path / "hf")
    ours = T5Model(config).eval()
    load_full_state_dict(ours, dict(tensors))
    assert_same_logits(ours, hf)


TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "  leading,   repeated and trailing spaces  \t tabs\nnew lines\r\n",
    "北京是中华人民共和国的首都，也是全国的政治和文化中心。",
    "龘靐齉爩 鬱 𠀋𪚥 — rare traditional characters outside the vocabulary",
    "emoji 😀🎉👩‍👩‍👧 and symbols ∮ ⌘ ☃ ♞",
    "ｆｕｌｌｗｉｄｔｈ ＡＢＣ１２３ and ﬁ ligatures ①② normalised",
    "sentinels <extra_id_0> in <extra_id_99>text</s> <pad>x<unk> and <extra_id_100> stays",
    "a literal <0x41> is text, not a byte piece",
    "Ꭰ ᚠ ሀ ᠠ scripts the corpus never saw",
    "", " ",
]


def corpus_sample(corpora_dir, per_corpus=12, chars=1500):
    out = []
    for path in sorted(corpora_dir.glob("*.jsonl")):
        with open(path, encoding="utf-8") as f:
            for _, line in zip(range(per_corpus), f):
                out.append(json.loads(line)["text"][:chars])
    return out


def byte_runs_as_unk(ours, ids):
    """`ids` with each run of byte pieces replaced by one <unk>: what a tokenizer without byte
    fallback gives for the characters outside the vocabulary."""
    out = []
    for i in ids:
        byte = i < ours.sp_vocab_size and ours.id_to_piece(i).startswith("<0x")
        if not (byte and out and out[-1] is None):
            out.append(None if byte else i)
    return [ours.unk_id if i is None else i for i in out]


def test_tokenizer_gives_our_ids(spm_model, corpora_dir, tmp_path):
    """AutoTokenizer on the folder encodes every text, Chinese and English, to our tokenizer's
    ids (byte pieces for characters outside the vocabulary, sentinels, eos appended) and decodes
    them back to our text, special tokens kept or not; the folder names its class in
    tokenizer_config.json and config.json (either is enough) and says why in its README.
    T5Tokenizer.from_pretrained, as documented there, gives <unk> for each run of characters
    outside the vocabulary (transformers 5.x rebuilds it without byte fallback) and our ids for
    every other text."""
    ours = OurTokenizer(str(spm_model))
    assert ours.vocab_size == VOCAB
    model = our_model("v1_0")
    out = write_hf_folder(tmp_path / "hf", model.config, gather_full_state_dict(model).items(),
                          tokenizer_model=spm_model)
    assert {"spiece.model", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "README.md"} <= {p.name for p in out.iterdir()}
    for name in ("tokenizer_config.json", "config.json"):
        assert json.loads((out / name).read_text())["tokenizer_class"] == \
            "PreTrainedTokenizerFast"
    readme = (out / "README.md").read_text()
    assert "AutoTokenizer.from_pretrained" in readme and "without byte fallback" in readme
    with transformers_warnings() as messages:
        tok = AutoTokenizer.from_pretrained(out)
    assert messages == []
    assert type(tok).__name__ == "TokenizersBackend"  # tokenizer.json as it is
    assert len(tok) == ours.vocab_size
    assert (tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == (1, 0, 2)
    assert tok.convert_tokens_to_ids(["<extra_id_0>", "<extra_id_99>"]) == \
        [ours.sentinel_id(0), ours.sentinel_id(99)]
    texts = TEXTS + corpus_sample(corpora_dir)
    for text in texts:
        ids = ours.encode(text)
        assert tok(text).input_ids == ids + [ours.eos_id], text
        assert tok(text, add_special_tokens=False).input_ids == ids, text
        spans = [ours.sentinel_id(0)] + ids + [ours.sentinel_id(1), ours.eos_id, ours.pad_id]
        for skip in (False, True):
            assert tok.decode(spans, skip_special_tokens=skip) == \
                ours.decode(spans, skip_special_tokens=skip), text
        assert tok.decode(spans) == ours.decode(spans)  # the same default: kept
    assert any(ours.id_to_piece(i).startswith("<0x") for i in ours.encode(TEXTS[3]))
    batch_ids = tok(texts[:4], padding=True).input_ids
    assert batch_ids[0][:len(ours.encode(texts[0])) + 1] == ours.encode(texts[0], add_eos=True)

    # config.json alone steers AutoTokenizer too (a tokenizer_config.json written by another
    # tool may lack the class)
    config = json.loads((out / "tokenizer_config.json").read_text())
    del config["tokenizer_class"]
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    again = AutoTokenizer.from_pretrained(out)
    assert type(again).__name__ == "TokenizersBackend"
    assert again(TEXTS[3]).input_ids == ours.encode(TEXTS[3], add_eos=True)

    slow = T5Tokenizer.from_pretrained(out)  # rebuilt by transformers without byte fallback
    with_bytes = 0
    for text in texts:
        ids = ours.encode(text)
        expected = byte_runs_as_unk(ours, ids)
        with_bytes += expected != ids
        assert slow(text, add_special_tokens=False).input_ids == expected, text
    assert with_bytes >= 5  # Chinese, emoji and other scripts outside the 4000 pieces


def test_tokenizer_decodes_generated_ids_as_ours(spm_model, tmp_path):
    """Ids a model generates, not only those of an encoded text: bare "▁" pieces before a word
    (the folder's Metaspace decoder drops the first token's "▁" only, SentencePiece every
    leading space), runs of byte pieces that are no UTF-8 (one U+FFFD per byte in the folder,
    SentencePiece keeps the valid ones), special tokens among them, skipped or kept: the folder
    and our tokenizer decode each sequence alike (lm_eval's hf backend decodes generations with
    the folder's tokenizer, megatron.evaluate with ours)."""
    import random

    from megatron.checkpoint.formats.hf_tokenizer import hf_tokenizer_files

    ours = OurTokenizer(str(spm_model))
    hf_tokenizer_files(spm_model).write(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    space = ours.piece_to_id("\u2581")
    words = ours.encode("A blue 是 ma") + ours.encode("the")
    byte_ids = [ours.piece_to_id(f"<0x{b:02X}>") for b in (0x20, 0x41, 0x0A, 0xE4, 0xBD, 0xA0)]
    pool = [space, space] + words + byte_ids + [0, 1, 2, ours.sentinel_id(0), ours.sentinel_id(1)]
    rng = random.Random(0)
    cases = [[0, space, *ours.encode("blue")], [space, space, *ours.encode("A")],
             [0, *byte_ids[2:5]], [byte_ids[1], 2, byte_ids[4]]]
    cases += [[rng.choice(pool) for _ in range(rng.randint(1, 7))] for _ in range(3000)]
    for ids in cases:
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == \
                tok.decode(ids, skip_special_tokens=skip), (ids, skip)
    assert ours.decode(cases[0], skip_special_tokens=True) == " blue"  # (not "blue")


def test_tokenizer_that_does_not_fit_the_model_is_refused(spm_model, tmp_path):
    small = T5Config(**{**CONFIGS["v1_0"], "vocab_size": 4000})
    with pytest.raises(HFFolderError, match="4100 token ids .* do not fit the model's "
                                            "vocab_size 4000"):
        write_hf_folder(tmp_path / "hf", small, iter(()), tokenizer_model=spm_model)
    with pytest.raises(HFFolderError, match="no such SentencePiece model"):
        write_hf_folder(tmp_path / "hf", small, iter(()), tokenizer_model=tmp_path / "none")
    assert list(tmp_path.iterdir()) == []


def test_bad_tensors_are_refused_and_leave_nothing(tmp_path):
    ours = our_model("v1_0")
    full = gather_full_state_dict(ours)
    out = tmp_path / "hf"
    cases = [
        ({**full, "lm_head.weight": full["shared.weight"]},
         "tensor lm_head.weight is not a parameter of this model \\(the config ties the head"),
        ({**full, "prompt.weight": full["shared.weight"][:4]},
         "tensor prompt.weight is not a parameter of this model \\(a --prompt-train-model "
         "checkpoint's tuned prompt: .* decode with python -m megatron.generate"),
        ({**full, "shared.weight": full["shared.weight"][:-1]},
         r"shared.weight has shape \(4099, 32\), the config needs \(4100, 32\)"),
        ({k: v for k, v in full.items() if "decoder.block.1" not in k},
         "tensor\\(s\\) of the model not given: decoder.block.1.layer.0.SelfAttention.q.weight"),
    ]
    for tensors, message in cases:
        with pytest.raises(HFFolderError, match=message):
            write_hf_folder(out, ours.config, tensors.items(), max_shard_size="30KB")
        assert list(tmp_path.iterdir()) == []
    twice = list(full.items()) + [("shared.weight", full["shared.weight"])]
    with pytest.raises(HFFolderError, match="tensor shared.weight given twice"):
        write_hf_folder(out, ours.config, twice)
    write_hf_folder(out, ours.config, full.items())
    with pytest.raises(HFFolderError, match="hf exists; pass force=True"):
        write_hf_folder(out, ours.config, full.items())
    write_hf_folder(out, ours.config, full.items(), force=True)
    with pytest.raises(HFFolderError, match="max_shard_size 'big'"):
        write_hf_folder(tmp_path / "other", ours.config, full.items(), max_shard_size="big")


def test_bad_folders_are_refused_by_file_and_tensor(tmp_path):
    hf = hf_model(CONFIGS["v1_1"], seed=6)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="60KB")
    sharded = tmp_path / "sharded"
    index_path = sharded / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())

    def copy(name):
        shutil.copytree(sharded, tmp_path / name)
        return tmp_path / name

    def read(folder):
        config, tensors = read_hf_folder(folder)
        return config, dict(tensors)

    folder = copy("truncated")
    shard = folder / index["weight_map"]["decoder.final_layer_norm.weight"]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(HFFolderError, match=f"{shard.name}: cannot read the weights"):
        read(folder)

    folder = copy("unlisted")
    broken = json.loads(index_path.read_text())
    file = broken["weight_map"].pop("encoder.block.1.layer.1.DenseReluDense.wo.weight")
    (folder / index_path.name).write_text(json.dumps(broken))
    with pytest.raises(HFFolderError, match=f"{file}: holds encoder.block.1.layer.1."
                                            f"DenseReluDense.wo.weight, which its index does"):
        read(folder)

    folder = copy("misplaced")
    moved = json.loads(index_path.read_text())
    other = next(f for f in sorted(set(moved["weight_map"].values())) if f != file)
    moved["weight_map"]["encoder.final_layer_norm.weight"] = other
    (folder / index_path.name).write_text(json.dumps(moved))
    with pytest.raises(HFFolderError, match="(holds encoder.final_layer_norm.weight, which its "
                                            "index does not list|lacks encoder.final_layer_norm"
                                            ".weight, which the index places there)"):
        read(folder)

    folder = copy("no_shard")
    (folder / file).unlink()
    with pytest.raises(HFFolderError, match=f"index.json: places .* in {file}, which is missing"):
        read(folder)

    folder = copy("bert")
    (folder / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 32}))
    with pytest.raises(HFFolderError, match="model_type 'bert' is not T5"):
        read(folder)

    folder = copy("pruned")
    config = json.loads((sharded / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "pruned_heads": {"0": [1]}}))
    with pytest.raises(HFFolderError, match="pruned_heads .* is not supported"):
        read(folder)

    folder = copy("more_layers")
    (folder / "config.json").write_text(json.dumps({**config, "num_decoder_layers": 4}))
    with pytest.raises(HFFolderError, match="tensor\\(s\\) of the model missing \\(the index "
                                            "lists none of them\\): decoder.block.3"):
        read(folder)

    folder = copy("wider")
    (folder / "config.json").write_text(json.dumps({**config, "d_ff": 50}))
    with pytest.raises(HFFolderError, match=r"wi_0.weight has shape \(48, 32\), config.json "
                                            r"needs \(50, 32\)"):
        read(folder)

    folder = tmp_path / "own_embeddings"
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    state["decoder.embed_tokens.weight"] += 1
    save_bin_state(folder, hf, state)
    with pytest.raises(StateDictError, match="pytorch_model.bin: decoder.embed_tokens.weight "
                                             "differs from shared.weight"):
        read(folder)

    folder = tmp_path / "empty"
    folder.mkdir()
    (folder / "config.json").write_text((sharded / "config.json").read_text())
    with pytest.raises(HFFolderError, match="empty: no model.safetensors"):
        read(folder)
    (folder / "pytorch_model.bin").write_bytes(b"not a checkpoint")
    with pytest.raises(HFFolderError, match="pytorch_model.bin: cannot read the weights"):
        read(folder)


def save_bin_state(folder, hf, state):
    folder.mkdir()
    torch.save(state, folder / "pytorch_model.bin")
    hf.config.save_pretrained(folder)
