"""meta.json's one reader and writer (megatron/checkpoint/formats/meta.py): what a checkpoint is
as typed fields, read back as written, and derived from the flags of a meta.json written before
those fields were (as the revision before them wrote it); the errors that carry their field
rather than text to parse; the one prompt-base digest; the one pad-id rule."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron.checkpoint.formats.deepspeed_files import CheckpointReadError
from megatron.checkpoint.formats.meta import (PROMPT_ALONE, PROMPT_WITH_MODEL, CheckpointKind,
                                              kind_of, read_meta, write_meta)
from megatron.checkpoint.formats.upcycle import UpcycleError, upcycled_config
from megatron.checkpoint.formats.weights import write_weights_checkpoint
from megatron.checkpoint.io.checkpointing import (checkpoint_problems, layout_problems,
                                                  weights_checkpoint_problems)
from megatron.checkpoint.io.prompt import checkpoint_digest, prompt_checkpoint_problems
from megatron.data.tokenizers.tokenizer_names import pad_id_of
from megatron.model import T5Model
from megatron.model.config import ConfigError, T5Config
from megatron.model.prompt import PromptLayout, base_identity

LAYOUT = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
          "data_parallel_size": 1, "zero_stage": 1}
TINY = dict(vocab_size=256, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2)
BASE = {"load": "/ckpt/base", "iteration": 8, "digest": "ab" * 32,
        "of": "checkpoint full tensors"}


def previous_meta(prompt_tune=True, train_model=False, layout_recorded=True, moe=False):
    """meta.json as the trainer wrote it before the "checkpoint" section (commit 8772e0a:
    io/saver.py's keys, pretrain_t5._saver's model section, the resolved flags)."""
    config = T5Config(**TINY, **(dict(num_experts=4, router_type="topk", router_topk=2)
                                 if moe else {}))
    model = {"config": config.to_dict(), "make_vocab_size_divisible_by": 128,
             "precision": "fp32"}
    flags = {"prompt_tune": prompt_tune, "prompt_train_model": train_model,
             "prompt_length": 6, "prompt_positions": "0.5,0.5", "precision": "fp32"}
    if prompt_tune:
        model["prompt_base"] = BASE
        if layout_recorded:
            model["prompt_layout"] = {"length": 6, "ratios": [0.5, 0.5]}
    return {"iteration": 4, "consumed_samples": 32, "layout": LAYOUT, "world_size": 2,
            "lr_schedule": {"num_steps": 4}, "flags": flags, "model": model,
            "saved_at": "2026-11-01 10:00:00", "manifest": {}}


def written(tmp_path: Path, meta, kind=None) -> Path:
    folder = tmp_path / "iter_0000004"
    folder.mkdir(parents=True, exist_ok=True)
    write_meta(folder, meta, kind)
    return folder


@pytest.mark.parametrize("train_model, prompt", [(False, PROMPT_ALONE),
                                                 (True, PROMPT_WITH_MODEL)])
@pytest.mark.parametrize("layout_recorded", [True, False])
def test_a_checkpoint_saved_before_the_section_is_read_from_its_flags(
        tmp_path, train_model, prompt, layout_recorded):
    folder = written(tmp_path, previous_meta(True, train_model, layout_recorded))
    kind = kind_of(read_meta(folder))
    assert kind == CheckpointKind(prompt, PromptLayout(6, (0.5, 0.5)), BASE, None)
    assert kind.prompt_alone == (not train_model)


def test_an_old_checkpoint_without_a_prompt_and_one_with_experts(tmp_path):
    assert kind_of(previous_meta(prompt_tune=False)) == CheckpointKind()
    assert kind_of(previous_meta(prompt_tune=False, moe=True)) == \
        CheckpointKind(router_type="topk")


def test_the_kind_is_written_and_read_back_as_typed_fields(tmp_path):
    kind = CheckpointKind(PROMPT_ALONE, PromptLayout(6, (0.5, 0.5)), BASE, "switch")
    meta = previous_meta()
    del meta["model"]["prompt_base"], meta["model"]["prompt_layout"]
    meta["flags"]["prompt_tune"] = False  # the section, not the flags, says what it is
    folder = written(tmp_path, meta, kind)
    on_disk = json.loads((folder / "meta.json").read_text())
    assert on_disk["checkpoint"] == {"prompt": "alone", "prompt_base": BASE,
                                     "prompt_layout": {"length": 6, "ratios": [0.5, 0.5]},
                                     "router_type": "switch"}
    assert kind_of(read_meta(folder)) == kind
    # readers of the revision before the section find the base and layout where they were
    assert on_disk["model"]["prompt_base"] == BASE
    assert on_disk["model"]["prompt_layout"] == {"length": 6, "ratios": [0.5, 0.5]}


@pytest.mark.parametrize("section, field", [
    ({"prompt": "half"}, "prompt"),
    ({"prompt": "alone", "prompt_layout": {"length": "x", "ratios": [1]},
      "prompt_base": BASE}, "prompt_layout"),
    ({"prompt": "alone", "prompt_layout": None, "prompt_base": None}, "prompt"),
    ({"router": "topk"}, "router"),
])
def test_a_damaged_section_is_refused_naming_its_field(tmp_path, section, field):
    folder = written(tmp_path, {**previous_meta(), "checkpoint": section})
    with pytest.raises(CheckpointReadError, match=rf"meta.json \(checkpoint\.{field}\)"):
        read_meta(folder)


def test_a_resumed_save_is_named_by_its_label(tmp_path):
    save = tmp_path / "save"
    written(save, previous_meta())  # its model files missing: refused as incomplete
    (save / "latest_checkpointed_iteration.txt").write_text("4\n")
    label = f"--save {save} (resumed)"
    said = checkpoint_problems(str(save), LAYOUT, False, label=label)
    assert len(said) == 1 and said[0].startswith(f"{label}: the checkpoint of iteration 4 ")
    assert checkpoint_problems(str(save), LAYOUT, False)[0].startswith(f"--load {save}: ")
    now = {**LAYOUT, "tensor_model_parallel_size": 2}
    said = layout_problems(LAYOUT, now, str(save), False, label)
    assert said[0].startswith(f"{label}: the checkpoint was saved with another layout")
    assert f"convert_checkpoint.py --load {save} " in said[0]  # the tool's own flag
    assert weights_checkpoint_problems(str(save), False, label=label)[0].startswith(
        f"{label} holds weights only")


def test_a_requeued_prompt_run_reads_what_its_save_holds_not_its_flags(tmp_path):
    save = tmp_path / "save"
    kind = CheckpointKind(PROMPT_WITH_MODEL, PromptLayout(6, (0.5, 0.5)), BASE)
    meta = previous_meta(prompt_tune=False)  # flags that would say "no prompt"
    written(save, meta, kind)
    (save / "latest_checkpointed_iteration.txt").write_text("4\n")
    values = {"prompt_tune": True, "save": str(save), "load": str(tmp_path / "base"),
              "prompt_train_model": False}
    said = prompt_checkpoint_problems(values)
    assert said and "holds a checkpoint of the model and a prompt" in said[0]


def test_config_errors_carry_each_field():
    with pytest.raises(ConfigError) as e:
        T5Config(**TINY, num_experts=4, router_type="topk", router_topk=5, dropout_rate=2.0)
    assert e.value.field == "dropout_rate"
    assert [f for f, _ in e.value.problems] == ["dropout_rate", "router_topk"]
    assert str(e.value) == "invalid model config: " + "; ".join(m for _, m in e.value.problems)
    with pytest.raises(UpcycleError) as up:
        upcycled_config(T5Config(**TINY), {"num_experts": 4, "router_topk": 5,
                                           "router_type": None})
    assert str(up.value) == ("--moe-router-topk: router_topk (5) must be between 1 and "
                             "num_experts (4)")


def test_one_digest_for_a_model_in_memory_and_its_checkpoint(tmp_path):
    torch.manual_seed(0)
    model = T5Model(T5Config(**TINY), 1, attention_backend="eager")
    out = write_weights_checkpoint(tmp_path / "w", model.state_dict().items(),
                                   {"config": model.config.to_dict()})
    assert checkpoint_digest(out / "iter_0000000") == \
        base_identity(model, None, None)["digest"]


def test_the_pad_id_comes_from_the_tokenizer_else_the_decoder_start():
    assert pad_id_of(SimpleNamespace(pad_id=5, decoder_start_token_id=1)) == 5
    assert pad_id_of(SimpleNamespace(decoder_start_token_id=0)) == 0
