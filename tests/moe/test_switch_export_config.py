"""The config.json of a SwitchTransformers export (megatron/checkpoint/formats/switch.py) against
transformers' own SwitchTransformersConfig: a top-1 model ('switch' routing) is written without
a k (transformers' routing has none; `"router_topk": 2` beside `"router_type": "switch"` said two
experts per token), every key transformers does not define is one of our documented fields, and
transformers' config and model load the folder; a 'topk' model (--allow-inexact-hf) keeps its k
so that it reads back exactly."""

import json

import pytest
from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

from megatron.checkpoint.formats.hf import read_hf_config

from test_moe_convert import SWITCH, convert, model_of, weights_checkpoint

OUR_FIELDS = {"router_type", "feed_forward_proj", "expert_capacity_factor",
              "eval_expert_capacity_factor", "moe_expert_bias", "scale_decoder_outputs",
              "decoder_start_token_id", "torch_dtype", "dtype"}
"""What switch.py documents writing beside transformers' fields (the sparse steps are
transformers' own attributes, recomputed from num_sparse_*_layers)."""


def export(tmp_path, fields, *extra):
    ours = model_of(fields).eval()
    hf_dir = tmp_path / "hf"
    assert convert("--load", weights_checkpoint(ours, tmp_path / "w"), "--to", "hf", hf_dir,
                   *extra) == 0
    return ours, hf_dir


@pytest.mark.parametrize("router", ["switch", "base"])
def test_top1_export_has_no_k_and_loads_in_transformers(tmp_path, router):
    extra = ("--allow-inexact-hf",) if router == "base" else ()
    ours, hf_dir = export(tmp_path, {**SWITCH, "router_type": router}, *extra)
    written = json.loads((hf_dir / "config.json").read_text())
    assert "router_topk" not in written
    assert written["router_type"] == router
    known = set(SwitchTransformersConfig().to_dict())
    assert set(written) - known <= OUR_FIELDS, set(written) - known - OUR_FIELDS
    hf_config = SwitchTransformersConfig.from_pretrained(hf_dir)
    assert not hasattr(hf_config, "router_topk")
    assert (hf_config.num_experts, hf_config.num_layers, hf_config.num_decoder_layers) == (
        ours.config.num_experts, ours.config.num_layers, ours.config.num_decoder_layers)
    hf, info = SwitchTransformersForConditionalGeneration.from_pretrained(
        hf_dir, output_loading_info=True)
    assert not any(info.values()), info
    assert [b.is_sparse for b in hf.encoder.block] == [b.is_sparse for b in ours.encoder.block]
    # what our reader builds back: top-1, the same config as the model exported
    back = read_hf_config(hf_dir / "config.json")
    assert back.router_k == 1
    assert back.to_dict() == ours.config.to_dict()


def test_topk_export_keeps_its_k(tmp_path):
    ours, hf_dir = export(tmp_path, {**SWITCH, "router_type": "topk", "router_topk": 3},
                          "--allow-inexact-hf")
    written = json.loads((hf_dir / "config.json").read_text())
    assert (written["router_type"], written["router_topk"]) == ("topk", 3)
    back = read_hf_config(hf_dir / "config.json")
    assert back.router_k == 3 and back.to_dict() == ours.config.to_dict()
    SwitchTransformersConfig.from_pretrained(hf_dir)  # transformers ignores our fields
