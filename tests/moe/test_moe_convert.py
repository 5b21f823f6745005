"""Converting Mixture-of-Experts models (data_tools/convert_checkpoint.py) in one process:

- ours -> Hugging Face SwitchTransformers: the folder loads in transformers with no missing or
  unexpected tensor and gives our logits (evaluation, nothing dropped); ours -> HF -> ours is bit
  for bit, config included; a model transformers would compute differently is refused unless
  --allow-inexact-hf, and then still comes back exactly; gated experts are refused.
- a weights checkpoint gives each expert rank its experts.
- upcycling a dense model (--num-experts): with top-k renormalised weights it computes the dense
  model; with switch routing the dense model whose sparse feed-forwards are scaled by 1 / E, with
  BASE by 1 / 2 (megatron/checkpoint/formats/upcycle.py); the balancing losses at step 0."""

import json
import math

import pytest
import torch

from data_tools import convert_checkpoint
from megatron.checkpoint.formats.weights import (
    WeightsReader,
    full_tensors,
    load_into,
    write_weights_checkpoint,
)
from megatron.model import T5Model
from megatron.model.config import T5Config
from megatron.model.state_dict import gather_full_state_dict, load_full_state_dict
from megatron.tensor_parallel.group import ExpertParallel

from moe_batches import VOCAB, batch

BASE = dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_heads=4, num_layers=3,
            num_decoder_layers=2, dropout_rate=0.0)
SWITCH = dict(BASE, num_experts=4, encoder_sparse_step=2, decoder_sparse_step=1,
              tie_word_embeddings=False, router_z_loss_coef=0.003, router_aux_loss_coef=0.02)


def model_of(fields, seed=0, **kw):
    torch.manual_seed(seed)
    model = T5Model(T5Config(**fields), 1, attention_backend="eager", **kw)
    with torch.no_grad():  # a readable routing (the default router is nearly uniform)
        for name, p in model.named_parameters():
            if "router" in name:
                p.normal_(0, 0.5)
    return model


def full_state(model):
    """Parameters and persistent buffers (expert biases), full."""
    state = gather_full_state_dict(model)
    params = dict(model.named_parameters())
    state.update((n, t.detach().clone()) for n, t in model.state_dict().items()
                 if n not in params)
    return state


def weights_checkpoint(model, path):
    write_weights_checkpoint(path, full_state(model).items(), {"config": model.config.to_dict()})
    return path


def convert(*argv):
    return convert_checkpoint.main([*map(str, argv), "--no-progress"])


def read_back(out):
    """A weights checkpoint's config and tensors."""
    folder = out / "iter_0000000"
    meta = json.loads((folder / "meta.json").read_text())
    return T5Config.from_dict(meta["model"]["config"]), dict(full_tensors(WeightsReader(folder)))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_switch_export_loads_in_transformers_and_round_trips(tmp_path, tied):
    from transformers import SwitchTransformersForConditionalGeneration

    ours = model_of({**SWITCH, "tie_word_embeddings": tied}).eval()
    hf_dir, back = tmp_path / "hf", tmp_path / "back"
    assert convert("--load", weights_checkpoint(ours, tmp_path / "w"), "--to", "hf", hf_dir) == 0
    hf, info = SwitchTransformersForConditionalGeneration.from_pretrained(
        hf_dir, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensor
    assert [b.is_sparse for b in hf.encoder.block] == [b.is_sparse for b in ours.encoder.block]
    assert [b.is_sparse for b in hf.decoder.block] == [b.is_sparse for b in ours.decoder.block]
    enc, dec, labels = batch()
    with torch.no_grad():
        want = ours(enc, dec, labels=labels).logits[..., :VOCAB]
        got = hf.eval()(input_ids=enc, decoder_input_ids=dec).logits
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    # ours -> HF -> ours, with the experts for two expert ranks: the same tensors, bit for bit
    assert convert("--from", "hf", hf_dir, "--to", "megatron", back,
                   "--target-expert-parallel-size", "2") == 0
    config, tensors = read_back(back)
    assert config.to_dict() == ours.config.to_dict()
    state = full_state(ours)
    assert tensors.keys() == state.keys()
    assert all(torch.equal(tensors[n], state[n]) for n in state)
    readme = (hf_dir / "README.md").read_text()
    assert "SwitchTransformersForConditionalGeneration" in readme and "exactly" not in readme


def test_inexact_exports_are_refused_unless_allowed(tmp_path, capsys):
    fields = {**SWITCH, "router_type": "topk", "router_topk": 2, "moe_expert_bias": True}
    ours = model_of(fields)
    with torch.no_grad():  # as trained: biases that move the choice
        for name, buffer in ours.named_buffers():
            buffer.copy_(torch.randn_like(buffer) * 0.1)
    w, hf_dir, back = weights_checkpoint(ours, tmp_path / "w"), tmp_path / "hf", tmp_path / "b"
    assert convert("--load", w, "--to", "hf", hf_dir) == 1
    err = capsys.readouterr().err
    assert "top-2 routing" in err and "expert biases" in err and "--allow-inexact-hf" in err
    assert not hf_dir.exists()
    assert convert("--load", w, "--to", "hf", hf_dir, "--allow-inexact-hf") == 0
    assert "top-2 routing" in (hf_dir / "README.md").read_text()
    assert convert("--from", "hf", hf_dir, "--to", "megatron", back) == 0
    config, tensors = read_back(back)
    assert config.to_dict() == ours.config.to_dict()
    state = full_state(ours)
    assert tensors.keys() == state.keys()
    assert all(torch.equal(tensors[n], state[n]) for n in state)
    gated = model_of({**SWITCH, "feed_forward_proj": "gated-gelu"})
    assert convert("--load", weights_checkpoint(gated, tmp_path / "g"), "--to", "hf",
                   tmp_path / "ghf", "--allow-inexact-hf") == 1
    assert "gated feed-forwards" in capsys.readouterr().err


def test_each_expert_rank_loads_its_experts(tmp_path):
    """A weights checkpoint into the model of expert rank 1 of 2 (experts 2 and 3), TP 1."""
    ours = model_of({**SWITCH, "feed_forward_proj": "gated-gelu"})
    state = full_state(ours)
    reader = WeightsReader(weights_checkpoint(ours, tmp_path / "w") / "iter_0000000")
    torch.manual_seed(1)
    rank1 = T5Model(ours.config, 1, attention_backend="eager",
                    expert_parallel=ExpertParallel(2, 1))
    problems = load_into(rank1, {n: n for n, _ in rank1.named_parameters()}, reader, VOCAB, 0, 1,
                         experts=(1, 2))
    assert problems == []
    for name, param in rank1.named_parameters():
        want = state[name][2:] if getattr(param, "expert_parallel", False) else state[name]
        if name == "shared.weight":
            want = torch.cat([want, want.new_zeros(param.shape[0] - VOCAB, want.shape[1])])
        assert torch.equal(param.detach(), want), name


DENSE = dict(BASE, feed_forward_proj="gated-gelu", tie_word_embeddings=False)


def upcycled(tmp_path, dense, *flags, via_hf=False):
    """The dense model upcycled by the tool, from our weights checkpoint or its HF folder."""
    out, source = tmp_path / "up", ["--load", weights_checkpoint(dense, tmp_path / "dense")]
    if via_hf:
        assert convert(*source, "--to", "hf", tmp_path / "dense_hf") == 0
        source = ["--from", "hf", tmp_path / "dense_hf"]
    assert convert(*source, "--to", "megatron", out, "--num-experts", "4", *flags) == 0
    config, tensors = read_back(out)
    model = T5Model(config, 1, attention_backend="eager")
    load_full_state_dict(model, tensors)
    return model


def scaled_ffn(dense, factor):
    """The dense model with the output projection of the feed-forwards that upcycling makes
    sparse (every block here) multiplied by `factor`: FFN(x) x factor."""
    out = T5Model(dense.config, 1, attention_backend="eager")
    out.load_state_dict(dense.state_dict())
    with torch.no_grad():
        for name, p in out.named_parameters():
            if ".DenseReluDense.wo." in name:
                p.mul_(factor)
    return out


def losses(model, train=False):
    enc, dec, labels = batch(1)
    model.train(train)
    with torch.no_grad():
        return model(enc, dec, labels=labels)


@pytest.mark.parametrize("via_hf", [False, True], ids=["ours", "from_hf"])
def test_upcycled_topk_is_the_dense_model(tmp_path, via_hf):
    dense = model_of(DENSE)
    moe = upcycled(tmp_path, dense, "--moe-router-topk", "2", via_hf=via_hf)
    assert moe.config.router_type == "topk" and moe.config.num_experts == 4
    want, got = losses(dense), losses(moe)
    assert torch.allclose(got.logits, want.logits, rtol=1e-6, atol=1e-6)
    assert float(got.loss) == pytest.approx(float(want.loss), rel=1e-6)
    # training mode (no dropout here): the same loss, plus each stack's balancing losses at a
    # zero router: aux k = 2, z (ln 4)^2, times their coefficients
    trained = losses(moe, train=True)
    assert float(trained.loss) == pytest.approx(float(want.loss), rel=1e-6)
    config = moe.config
    per_stack = config.router_aux_loss_coef * 2 + config.router_z_loss_coef * math.log(4) ** 2
    assert float(trained.aux_loss) == pytest.approx(2 * per_stack, rel=1e-5)


@pytest.mark.parametrize("router,factor", [("switch", 1 / 4), ("base", 1 / 2)])
def test_upcycled_switch_and_base_scale_the_feed_forward(tmp_path, router, factor):
    dense = model_of(DENSE)
    moe = upcycled(tmp_path, dense, "--moe-router-type", router)
    want, got = losses(scaled_ffn(dense, factor)), losses(moe)
    assert torch.allclose(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    assert float(got.loss) != pytest.approx(float(losses(dense).loss), rel=1e-4)


def test_upcycling_sparse_steps_and_refusals(tmp_path, capsys):
    dense = model_of(DENSE)
    moe = upcycled(tmp_path, dense, "--moe-router-topk", "2", "--moe-encoder-sparse-step", "2",
                   "--moe-decoder-sparse-step", "0")
    assert [b.is_sparse for b in moe.encoder.block] == [False, True, False]
    assert [b.is_sparse for b in moe.decoder.block] == [False, False]
    assert torch.allclose(losses(moe).logits, losses(dense).logits, rtol=1e-6, atol=1e-6)
    w = tmp_path / "dense"  # written by upcycled()
    assert convert("--load", w, "--to", "megatron", tmp_path / "x", "--moe-router-topk", "2") == 2
    assert "need --num-experts" in capsys.readouterr().err
    assert convert("--load", w, "--to", "hf", tmp_path / "x", "--num-experts", "4") == 2
    assert convert("--load", w, "--to", "megatron", tmp_path / "x", "--num-experts", "4",
                   "--moe-router-topk", "5") == 2
    assert "--moe-router-topk" in capsys.readouterr().err
    moe_w = weights_checkpoint(model_of(SWITCH), tmp_path / "moe")
    assert convert("--load", moe_w, "--to", "megatron", tmp_path / "x", "--num-experts", "8") == 2
    assert "experts already" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_the_trainer_names_the_expert_conversion():
    """A resume with another expert-parallel size is refused with the command that converts."""
    from megatron.checkpoint.io.checkpointing import layout_problems

    saved = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
             "data_parallel_size": 4, "zero_stage": 1, "expert_model_parallel_size": 2}
    for now, target in (({**saved, "expert_model_parallel_size": 4}, "4"),
                        ({k: v for k, v in saved.items() if k != "expert_model_parallel_size"},
                         "1")):
        problems = layout_problems(saved, now, "ckpt", weights_only=False)
        assert len(problems) == 1
        assert f"--expert-model-parallel-size 2 in the checkpoint, {target} now" in problems[0]
        assert f"--target-expert-parallel-size {target}`" in problems[0]


@pytest.mark.parametrize("ep,tp", [(2, 1), (4, 1), (2, 2)])
def test_every_expert_and_tensor_rank_draws_the_single_process_experts(ep, tp):
    """Initialization: rank (e, t) of EP x TP draws only its experts, and they are exactly its
    slice of the single-process model's (each expert drawn from its own seed, which the block's
    stream gives every rank)."""
    from megatron.tensor_parallel.group import TensorParallel

    fields = {**SWITCH, "feed_forward_proj": "gated-gelu"}
    state = full_state(model_of(fields))
    local = fields["num_experts"] // ep
    for e in range(ep):
        for t in range(tp):
            model = model_of(fields, tensor_parallel=TensorParallel(tp, t),
                             expert_parallel=ExpertParallel(ep, e))
            for name, param in model.named_parameters():
                if not getattr(param, "expert_parallel", False):
                    continue
                want = state[name][e * local:(e + 1) * local]
                dim = param.partition_dim
                size = want.shape[dim] // tp
                assert torch.equal(param.detach(), want.narrow(dim, t * size, size)), name
