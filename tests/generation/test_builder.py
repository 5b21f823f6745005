"""megatron/pipeline/builder.py, the one builder of a model from tensors, and the stage plan it
reads (Cut.stage_modules): in one process, the tensor-parallel shard of a rank built without
its process group (nothing here runs a collective)."""

import pytest
import torch
from generation_models import CONFIGS

from megatron.model import T5Config, T5Model
from megatron.model.prompt import PromptLayout
from megatron.model.state_dict import StateDictError, gather_full_state_dict, \
    load_full_state_dict
from megatron.pipeline.builder import build_model, load_tensors, model_from_tensors
from megatron.pipeline.partition import BIAS_TABLE, Cut, cut_model
from megatron.tensor_parallel.group import ExpertParallel, TensorParallel

MOE = dict(CONFIGS["v1_1"], num_experts=4, router_type="switch",
           moe_expert_bias=True)
ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride", "expert_parallel")


def how(tp_rank=0, tp_size=2, ep=ExpertParallel(), **kw):
    return dict(make_vocab_size_divisible_by=8, backend="eager",
                tp=TensorParallel(tp_size, tp_rank), ep=ep, device="cpu", dtype=torch.float32,
                **kw)


def full_tensors(fields, seed=3):
    torch.manual_seed(seed)
    return gather_full_state_dict(T5Model(T5Config(**fields), make_vocab_size_divisible_by=8))


def attributes(model):
    return {name: {a: getattr(p, a) for a in ATTRIBUTES if hasattr(p, a)}
            for name, p in model.named_parameters()}


@pytest.mark.parametrize("fields", [CONFIGS["v1_0"], MOE], ids=["dense", "moe"])
def test_to_empty_drops_the_tensor_parallel_attributes_and_the_builder_keeps_them(fields):
    """`to_empty` of a model built on the meta device (the old validation copy) makes new
    Parameters without the attributes that say how a full tensor is split; the builder's
    uninitialised model carries the same attributes as one built on the device."""
    config = T5Config(**fields)
    ep = ExpertParallel(2, 1) if config.is_moe else ExpertParallel()
    on_device = T5Model(config, make_vocab_size_divisible_by=8, tensor_parallel=TensorParallel(
        2, 1), expert_parallel=ep)
    want = attributes(on_device)
    assert any(a.get("tensor_model_parallel") for a in want.values())
    emptied = T5Model(config, make_vocab_size_divisible_by=8, device="meta",
                      tensor_parallel=TensorParallel(2, 1), expert_parallel=ep)
    emptied.to_empty(device="cpu")
    assert not any(a.get("tensor_model_parallel") for a in attributes(emptied).values())
    built = build_model(config, initialize=False, **how(1, ep=ep))
    assert attributes(built) == want
    assert not any(t.is_meta for t in built.state_dict().values())


@pytest.mark.parametrize("rank", [0, 1])
def test_from_full_tensors_at_tp2_each_rank_holds_its_shard(rank):
    """A whole model at TP 2 from full tensors equals the model built on the device and
    loaded (model/state_dict.py: each rank's slice); from those shards (`sharded`, no weights
    drawn) the same again."""
    config = T5Config(**CONFIGS["v1_1"])
    full = full_tensors(CONFIGS["v1_1"])
    want = T5Model(config, make_vocab_size_divisible_by=8,
                   tensor_parallel=TensorParallel(2, rank))
    load_full_state_dict(want, full)
    got = model_from_tensors(config, full.items(), **how(rank))
    again = model_from_tensors(config, want.state_dict().items(), sharded=True, **how(rank))
    assert not got.training and not again.training
    for model in (got, again):
        assert model.state_dict().keys() == want.state_dict().keys()
        for name, tensor in want.state_dict().items():
            assert torch.equal(model.state_dict()[name], tensor), name
    assert attributes(again) == attributes(want)


def test_sharded_tensors_must_fill_the_model():
    config = T5Config(**CONFIGS["v1_0"])
    state = dict(T5Model(config, make_vocab_size_divisible_by=8).state_dict())
    del state["decoder.final_layer_norm.weight"]
    model = build_model(config, initialize=False, **how(0, tp_size=1))
    with pytest.raises(StateDictError, match="missing: decoder.final_layer_norm.weight"):
        load_tensors(model, state.items(), sharded=True)


def test_stage_modules_of_a_three_stage_cut():
    """Hand-written: encoder blocks 0-1 | encoder 2, decoder 0 | decoder 1-2, untied head."""
    cut = Cut(3, 3, (0, 2, 4, 6), None, (0.0,) * 3)
    assert cut.stage_modules(0, False) == ["shared", "encoder.block.0", "encoder.block.1"]
    assert cut.stage_modules(1, False) == [
        f"encoder.{BIAS_TABLE}", "encoder.block.2", "encoder.final_layer_norm", "shared",
        "decoder.block.0"]
    assert cut.stage_modules(2, False) == [
        f"decoder.{BIAS_TABLE}", "decoder.block.1", "decoder.block.2",
        "decoder.final_layer_norm", "lm_head"]
    assert cut.stage_modules(2, True)[-1] == "shared"


@pytest.mark.parametrize("name", ["v1_0", "v1_1"])
def test_each_stage_holds_its_modules_and_together_the_whole_model(name):
    """A stage's model (tensor-parallel rank 1 of 2) holds the parameters of its modules
    (Cut.stage_modules) on the device, each equal to the whole model's, the rest on the meta
    device; a tuned prompt on stage 0 only."""
    config = T5Config(**CONFIGS[name])
    full = full_tensors(CONFIGS[name])
    layout = PromptLayout(3)
    full["prompt.weight"] = torch.randn(3, config.d_model)
    whole = model_from_tensors(config, full.items(), **how(1, prompt_layout=layout))
    cut = cut_model(config, 3)
    seen = set()
    for stage in range(3):
        model = model_from_tensors(config, full.items(),
                                   **how(1, cut=cut, stage=stage, prompt_layout=layout))
        held = {n: p for n, p in model.named_parameters() if not p.is_meta}
        modules = cut.stage_modules(stage, config.tie_word_embeddings)
        modules += ["prompt"] if stage == 0 else []
        assert set(held) == {f"{m}.{n}" for m in modules
                             for n, _ in model.get_submodule(m).named_parameters()}
        for n, p in held.items():
            assert torch.equal(p, whole.get_parameter(n)), n
        seen |= set(held)
    assert seen == {n for n, _ in whole.named_parameters()}


def test_building_draws_nothing_from_the_default_generator():
    """A validation copy is built between training steps: the run's random stream goes on."""
    config = T5Config(**CONFIGS["v1_0"])
    torch.manual_seed(11)
    before = torch.get_rng_state()
    build_model(config, prompt_layout=PromptLayout(4), **how(0))
    build_model(config, cut=cut_model(config, 2), stage=0, prompt_layout=PromptLayout(4),
                **how(0))
    assert torch.equal(torch.get_rng_state(), before)
