"""Hugging Face folders: what transformers' save_pretrained writes, read by us as its
from_pretrained reads it (tied or untied head, decided from the tensors), and our weights written
back as a folder that from_pretrained turns into the same model. Nothing is dropped silently."""

import json

import pytest
import safetensors.torch
import torch
from test_hf_parity import CONFIGS, VOCAB, hf_model, padded_batch
from transformers import T5ForConditionalGeneration

from megatron.model import T5Config, T5Model
from megatron.checkpoint.formats.hf import read_hf_checkpoint
from megatron.model.state_dict import (
    StateDictError,
    from_hf_checkpoint,
    from_hf_state_dict,
    gather_full_state_dict,
    load_full_state_dict,
    to_hf_state_dict,
)


def trained_looking(hf):
    """Every weight moved off its initial value (the norms off 1.0), so a wrong mapping shows."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in hf.parameters():
            param.mul_(torch.empty(param.shape).uniform_(0.5, 1.5, generator=g))
    return hf


def assert_same_outputs(ours, ref):
    """Logits and loss of our model and a Hugging Face one, relative to their magnitude."""
    enc, dec, enc_mask, dec_mask, labels = padded_batch()
    with torch.no_grad():
        expected = ref(input_ids=enc, attention_mask=enc_mask, decoder_input_ids=dec,
                       decoder_attention_mask=dec_mask, labels=labels)
        out = ours(enc, dec, enc_mask, dec_mask, labels)
    scale = expected.logits.abs().max().item()
    torch.testing.assert_close(out.logits[..., :VOCAB], expected.logits, rtol=1e-4,
                               atol=1e-5 * scale)
    assert out.loss.item() == pytest.approx(expected.loss.item(), rel=1e-5)


def write_hf_folder(directory, config, hf_state):
    """What save_pretrained writes: config.json and model.safetensors (no shared storage)."""
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config.to_hf_dict()))
    safetensors.torch.save_file({k: v.clone().contiguous() for k, v in hf_state.items()},
                                directory / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_save_pretrained_folder_loads_as_from_pretrained_loads(name, tmp_path):
    """transformers 5.x writes tie_word_embeddings true even for an untied v1.1 model and keeps
    its head untied on load because lm_head.weight differs from shared.weight; so do we. And our
    weights, written back as a Hugging Face folder, give from_pretrained the same model."""
    torch.manual_seed(6)
    tied = CONFIGS[name]["tie_word_embeddings"]
    trained_looking(hf_model(CONFIGS[name])).save_pretrained(tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["tie_word_embeddings"]
    ref = T5ForConditionalGeneration.from_pretrained(tmp_path / "hf", attn_implementation="eager")
    assert (ref.lm_head.weight is ref.shared.weight) == tied

    config, full = read_hf_checkpoint(tmp_path / "hf")
    assert config.tie_word_embeddings == tied and config.scale_decoder_outputs == tied
    assert ("lm_head.weight" in full) != tied
    ours = T5Model(config).eval()
    load_full_state_dict(ours, full)
    assert_same_outputs(ours, ref.eval())

    back = to_hf_state_dict(gather_full_state_dict(ours), config)
    write_hf_folder(tmp_path / "back", config, back)
    again = T5ForConditionalGeneration.from_pretrained(tmp_path / "back",
                                                       attn_implementation="eager")
    assert (again.lm_head.weight is again.shared.weight) == tied
    assert_same_outputs(ours, again.eval())


def test_head_equal_to_the_embedding_is_tied_and_keeps_its_scaling(tmp_path):
    """A v1.1 config (untied, unscaled) whose lm_head.weight equals shared.weight: Hugging Face
    ties the head and keeps the outputs unscaled; so do we, and nothing is left over."""
    torch.manual_seed(8)
    hf = trained_looking(hf_model(CONFIGS["v1_1"]))
    with torch.no_grad():
        hf.lm_head.weight.copy_(hf.shared.weight)
    config = T5Config(**CONFIGS["v1_1"])
    write_hf_folder(tmp_path / "hf", config, hf.state_dict())
    ref = T5ForConditionalGeneration.from_pretrained(tmp_path / "hf", attn_implementation="eager")
    assert ref.lm_head.weight is ref.shared.weight and not ref.config.scale_decoder_outputs

    ours_config, full = from_hf_checkpoint(config, hf.state_dict())
    assert ours_config.tie_word_embeddings and not ours_config.scale_decoder_outputs
    assert set(full) == {n for n, _ in T5Model(ours_config).named_parameters()}
    ours = T5Model(ours_config).eval()
    load_full_state_dict(ours, full)
    assert_same_outputs(ours, ref.eval())


def test_tensors_that_would_be_lost_are_errors():
    """An untied head read under a tied config, or an encoder embedding of its own: refused, with
    the name, instead of dropped."""
    torch.manual_seed(9)
    hf = hf_model(CONFIGS["v1_1"]).state_dict()
    tied = T5Config(**{**CONFIGS["v1_1"], "tie_word_embeddings": True})
    with pytest.raises(StateDictError, match="lm_head.weight differs from shared.weight: the "
                                             "config ties the head"):
        from_hf_state_dict(hf, tied)
    hf["encoder.embed_tokens.weight"] = hf["shared.weight"] + 1
    with pytest.raises(StateDictError, match="encoder.embed_tokens.weight differs from "
                                             "shared.weight: this model has one embedding"):
        from_hf_checkpoint(tied, hf)


def test_sharded_folder_and_a_folder_without_weights(tmp_path):
    torch.manual_seed(10)
    hf = trained_looking(hf_model(CONFIGS["v1_1"]))
    hf.save_pretrained(tmp_path / "one")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="50KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    _, one = read_hf_checkpoint(tmp_path / "one")
    config, sharded = read_hf_checkpoint(tmp_path / "sharded")
    assert not config.tie_word_embeddings
    assert set(one) == set(sharded) and all(torch.equal(one[k], sharded[k]) for k in one)
    (tmp_path / "one" / "model.safetensors").unlink()
    with pytest.raises(StateDictError, match="one: no model.safetensors"):
        read_hf_checkpoint(tmp_path / "one")
