"""T5Config: presets, Hugging Face and CPM-2 files, refusals; parameter counts against HF."""

import json
import math

import pytest
import torch
from transformers import T5Config as HFConfig
from transformers import T5ForConditionalGeneration

from megatron.model import ConfigError, T5Config, T5Model, load_preset
from megatron.model.config import PRESET_DIR
from megatron.model.meta import num_parameters
from megatron.model.state_dict import from_hf_state_dict

PRESETS = sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def test_all_presets_exist():
    assert PRESETS == sorted([
        "t5-small", "t5-base", "t5-large", "t5-3b", "t5-11b", "t5-v1_1-small", "t5-v1_1-base",
        "t5-v1_1-large", "t5-v1_1-xl", "t5-v1_1-xxl", "cpm2-11b", "t5-demo",
        "switch-base-8", "cpm2-moe-198b"])


@pytest.mark.parametrize("name", [n for n in PRESETS if not load_preset(n).is_moe])
def test_preset_parameter_count_matches_hugging_face(name):
    config = load_preset(name)
    hf_fields = {k: v for k, v in config.to_hf_dict().items() if k != "init_method_std"}
    with torch.device("meta"):
        hf = T5ForConditionalGeneration(HFConfig(**hf_fields))
        ours = T5Model(config, make_vocab_size_divisible_by=1, device="meta")
        if not config.tie_word_embeddings:  # transformers 5.x ties on construction; untie
            hf.lm_head.weight = torch.nn.Parameter(torch.empty_like(hf.lm_head.weight))
    hf_count = sum(p.numel() for p in hf.parameters())  # tied weights are one parameter
    ours_count = sum(p.numel() for p in ours.parameters())
    assert ours_count == hf_count == num_parameters(config)
    assert {n for n, _ in ours.named_parameters()} <= set(hf.state_dict())


def test_moe_preset_parameter_counts():
    """Switch-Base-8 against transformers' SwitchTransformers (619M, as google/switch-base-8);
    CPM-2-MoE by hand: CPM-2's 11B plus 31 more copies of each of its 48 gated feed-forwards
    and a router per block (198B)."""
    from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

    config = load_preset("switch-base-8")
    with torch.device("meta"):
        hf = SwitchTransformersForConditionalGeneration(SwitchTransformersConfig(
            vocab_size=config.vocab_size, d_model=config.d_model, d_kv=config.d_kv,
            d_ff=config.d_ff, num_layers=12, num_sparse_encoder_layers=6,
            num_decoder_layers=12, num_sparse_decoder_layers=6, num_heads=config.num_heads,
            num_experts=8))
        ours = T5Model(config, make_vocab_size_divisible_by=1, device="meta")
    assert sum(p.numel() for p in ours.parameters()) == \
        sum(p.numel() for p in hf.parameters()) == num_parameters(config) == 619_339_008
    moe, dense = load_preset("cpm2-moe-198b"), load_preset("cpm2-11b")
    ffn = 3 * dense.d_model * dense.d_ff
    blocks = dense.num_layers + dense.num_decoder_layers
    # its router is CPM-2's: frozen centroids [32, d_model] per block, a buffer, no parameter
    assert moe.router_type == "cpm2"
    assert num_parameters(moe) == num_parameters(dense) + blocks * 31 * ffn


def test_known_sizes():
    # Published sizes: t5-small 60.5M, t5-base 223M, t5-v1_1-xl 2.85B, t5-11b 11.3B.
    assert num_parameters(load_preset("t5-small")) == 60_506_624
    assert num_parameters(load_preset("t5-base")) == 222_903_552
    assert round(num_parameters(load_preset("t5-v1_1-xl")) / 1e9, 2) == 2.85
    assert round(num_parameters(load_preset("t5-11b")) / 1e9, 1) == 11.3


def test_hugging_face_config_json_loads(tmp_path):
    hf = HFConfig(vocab_size=1000, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                  num_decoder_layers=3, num_heads=4, feed_forward_proj="gated-gelu",
                  tie_word_embeddings=False, dropout_rate=0.0)
    path = tmp_path / "config.json"
    hf.to_json_file(path)
    config = T5Config.from_json(path)
    assert (config.vocab_size, config.d_model, config.d_kv, config.d_ff) == (1000, 64, 16, 128)
    assert (config.num_layers, config.num_decoder_layers, config.num_heads) == (2, 3, 4)
    assert config.is_gated_act and config.activation == "gelu_new"
    # transformers 5.x writes tie_word_embeddings true and the scaling separately.
    assert config.tie_word_embeddings is True and config.scale_decoder_outputs is False
    assert config.init_method == "t5x"


def test_transformers_4_style_v1_1_config_is_untied_and_unscaled():
    config = T5Config.from_dict({"d_model": 64, "d_ff": 128, "num_heads": 4, "d_kv": 16,
                                 "feed_forward_proj": "gated-gelu", "tie_word_embeddings": False,
                                 "model_type": "t5", "dense_act_fn": "gelu_new",
                                 "is_gated_act": True, "is_decoder": False})
    assert config.tie_word_embeddings is False and config.scale_decoder_outputs is False
    with pytest.raises(ConfigError, match="dense_act_fn 'relu' contradicts"):
        T5Config.from_dict({"feed_forward_proj": "gated-gelu", "dense_act_fn": "relu"})


def test_cpm2_config_uses_cpm2_initialization(tmp_path):
    path = tmp_path / "enc_dec_config.json"
    path.write_text(json.dumps({
        "d_model": 64, "d_ff": 96, "d_kv": 16, "num_heads": 4, "num_layers": 2,
        "num_decoder_layers": 1, "feed_forward_proj": "gated-gelu",
        "relative_attention_num_buckets": 32, "dropout_rate": 0.1, "layer_norm_epsilon": 1e-6,
        "init_method_std": 0.05, "vocab_size": 500, "tie_word_embeddings": True}))
    config = T5Config.from_json(path)
    assert config.init_method == "cpm2" and config.num_decoder_layers == 1
    torch.manual_seed(0)
    model = T5Model(config, make_vocab_size_divisible_by=1)
    q = model.encoder.block[0].layer[0].SelfAttention.q.weight
    o = model.encoder.block[0].layer[0].SelfAttention.o.weight
    wo_dec = model.decoder.block[0].layer[2].DenseReluDense.wo.weight
    assert abs(q.std().item() - 0.05) < 0.005
    assert abs(o.std().item() - 0.05 / 2.0) < 0.003  # 1 / sqrt(2 * 2 encoder layers)
    assert abs(wo_dec.std().item() - 0.05 / 2 ** 0.5) < 0.004  # the decoder's 1 layer
    assert len(model.decoder.block) == 1


def test_hf_initialization_scales():
    config = T5Config(vocab_size=512, d_model=256, d_kv=32, d_ff=1024, num_layers=1,
                      num_heads=8, tie_word_embeddings=False, init_method="hf")
    torch.manual_seed(0)
    model = T5Model(config)
    attention = model.encoder.block[0].layer[0].SelfAttention
    expected = {attention.q.weight: (256 * 32) ** -0.5, attention.k.weight: 256 ** -0.5,
                attention.o.weight: 256 ** -0.5,
                model.encoder.block[0].layer[1].DenseReluDense.wo.weight: 1024 ** -0.5,
                model.shared.weight[:512]: 1.0, model.lm_head.weight[:512]: 1.0}
    for weight, std in expected.items():
        assert weight.std().item() == pytest.approx(std, rel=0.05)
    assert torch.equal(model.encoder.final_layer_norm.weight, torch.ones(256))


# Every weight of a fresh model against the distribution its scheme draws from. A one-sample
# Kolmogorov-Smirnov distance to the scheme's distribution (t5x: documented below) or a
# two-sample one to Hugging Face's freshly initialized weights ('hf': its _init_weights is the
# reference) checks the shape and the scale; the standard deviation, within 5 standard errors,
# checks the scale more finely. KS bound: the distance a correct draw exceeds with probability
# 1e-6 (sqrt(ln(2 / 1e-6) / 2) = 2.694 times sqrt(1 / n + 1 / m)).
INIT_SIZES = dict(d_model=256, d_kv=32, d_ff=512, num_heads=16, relative_attention_num_buckets=256,
                  vocab_size=1024)
KS_C = (math.log(2 / 1e-6) / 2) ** 0.5
# A unit normal truncated to [-2, 2] has standard deviation 0.8796; t5x divides by it.
TRUNCATED_STD = 0.87962566103423978


def init_model(init_method):
    """A fresh gated-gelu, untied model of one encoder and one decoder block (seeded), in eval
    mode, without vocabulary padding."""
    config = T5Config(**INIT_SIZES, num_layers=1, feed_forward_proj="gated-gelu",
                      tie_word_embeddings=False, dropout_rate=0.0, init_method=init_method)
    torch.manual_seed(0)
    return T5Model(config, make_vocab_size_divisible_by=1).eval()


def empirical_cdf(sorted_sample, x):
    return torch.searchsorted(sorted_sample, x, right=True).double() / sorted_sample.numel()


def ks_distance(sample, cdf=None, other=None):
    """The largest gap between the sample's empirical distribution function and `cdf` (a
    function) or `other`'s (a second sample)."""
    x = sample.detach().flatten().double().sort().values
    if other is not None:
        y = other.detach().flatten().double().sort().values
        points = torch.cat([x, y])
        return (empirical_cdf(x, points) - empirical_cdf(y, points)).abs().max().item()
    f, n = cdf(x), x.numel()
    i = torch.arange(1, n + 1, dtype=torch.float64)
    return max((i / n - f).max().item(), (f - (i - 1) / n).max().item())


def normal_cdf(std):
    return lambda x: 0.5 * (1 + torch.erf(x / (std * 2 ** 0.5)))


def truncated_normal_cdf(std):
    """A normal truncated at 2 of its standard deviations, scaled so that its std is `std`."""
    scale, unit = std / TRUNCATED_STD, normal_cdf(1.0)
    low, high = unit(torch.tensor(-2.0, dtype=torch.float64)), \
        unit(torch.tensor(2.0, dtype=torch.float64))
    return lambda x: ((unit(x / scale) - low) / (high - low)).clamp(0, 1)


def uniform_cdf(std):
    limit = 3 ** 0.5 * std
    return lambda x: ((x + limit) / (2 * limit)).clamp(0, 1)


def t5x_scheme(name, sizes):
    """t5x (examples/t5/layers.py), by weight name: every dense kernel variance_scaling(1,
    fan_in), the MLP and the logits layer truncated at 2 (std after truncation fan_in ** -0.5),
    attention plain normal (q also / sqrt(d_kv)), relative bias variance_scaling(1, fan_avg,
    uniform), embedding normal(1). Returns (distribution function, standard deviation)."""
    d, inner = sizes["d_model"], sizes["num_heads"] * sizes["d_kv"]
    kind = name.split(".")[-2]
    stds = {"shared": (normal_cdf, 1.0), "lm_head": (truncated_normal_cdf, d ** -0.5),
            "q": (normal_cdf, (d * sizes["d_kv"]) ** -0.5), "k": (normal_cdf, d ** -0.5),
            "v": (normal_cdf, d ** -0.5), "o": (normal_cdf, inner ** -0.5),
            "wi_0": (truncated_normal_cdf, d ** -0.5), "wi_1": (truncated_normal_cdf, d ** -0.5),
            "wo": (truncated_normal_cdf, sizes["d_ff"] ** -0.5),
            "relative_attention_bias": (uniform_cdf, (2 / (sizes["num_heads"] + sizes[
                "relative_attention_num_buckets"])) ** 0.5)}
    cdf, std = stds[kind]
    return cdf(std), std


@pytest.mark.parametrize("init_method", ["t5x", "hf"])
def test_every_initial_weight_follows_its_scheme(init_method):
    """Every parameter of both stacks (self- and cross-attention, MLP, relative bias, norms,
    embedding, head) against its scheme's distribution (the comment above); norms start at 1.
    The first logits' scale follows from the head's: the final norm leaves each token's hidden
    state with rms 1, so their std is the head's std x sqrt(d_model) (t5x: 1, 'hf': 16); a
    uniform output (std 0) or a wrong head fails it."""
    assert T5Config(**INIT_SIZES).init_method == "t5x"  # the default
    model = init_model(init_method)
    if init_method == "hf":
        hf_fields = {k: v for k, v in model.config.to_hf_dict().items() if k != "init_method_std"}
        torch.manual_seed(1)
        hf = T5ForConditionalGeneration(HFConfig(**hf_fields))
        # transformers 5.x ties lm_head to the embedding on construction even for an untied
        # config: its lm_head is then the embedding, normal(1), as _init_weights draws an
        # untied head too
        reference = from_hf_state_dict(hf.state_dict(), model.config)
    checked = 0
    for name, weight in model.named_parameters():
        if name.endswith("layer_norm.weight"):
            assert torch.equal(weight, torch.ones_like(weight)), name
            continue
        n = weight.numel()
        if init_method == "t5x":
            cdf, std = t5x_scheme(name, INIT_SIZES)
            distance, bound = ks_distance(weight, cdf=cdf), KS_C / n ** 0.5
        else:
            want = reference[name]
            assert want.shape == weight.shape, name
            std = want.std().item()
            distance, bound = ks_distance(weight, other=want), KS_C * (2 / n) ** 0.5
        assert distance < bound, (name, distance, bound)
        # a normal sample's std has relative standard error (2n) ** -0.5 (less for the
        # truncated and uniform draws); against Hugging Face's sample, sqrt(2) times that
        error = (2 * n) ** -0.5 * (1 if init_method == "t5x" else 2 ** 0.5)
        assert weight.std().item() == pytest.approx(std, rel=5 * error), name
        assert abs(weight.mean().item()) < 5 * std / n ** 0.5, name
        checked += 1
    assert checked == sum(not n.endswith("layer_norm.weight") for n, _ in
                          model.named_parameters()) == 22
    g = torch.Generator().manual_seed(1)
    enc, dec = (torch.randint(2, INIT_SIZES["vocab_size"], (8, 32), generator=g)
                for _ in range(2))
    with torch.no_grad():
        logits = model(enc, dec).logits
    head_std = model.lm_head.weight.std().item()
    assert logits.std().item() == pytest.approx(head_std * INIT_SIZES["d_model"] ** 0.5,
                                                rel=0.05)


def test_unknown_keys_are_refused_with_a_suggestion(tmp_path):
    path = tmp_path / "model.json"
    path.write_text(json.dumps({"d_model": 64, "num_head": 4, "dff": 3}))
    with pytest.raises(ConfigError) as err:
        T5Config.from_json(path)
    message = str(err.value)
    assert str(path) in message and "'num_head' (did you mean 'num_heads'?)" in message
    assert "'dff'" in message


def test_bad_values_are_listed_together(tmp_path):
    path = tmp_path / "model.json"
    path.write_text(json.dumps({"d_model": 0, "feed_forward_proj": "gated-tanh",
                                "dropout_rate": 1.5, "model_type": "bart"}))
    with pytest.raises(ConfigError) as err:
        T5Config.from_json(path)
    message = str(err.value)
    for part in ("d_model must be a positive integer", "feed_forward_proj 'gated-tanh'",
                 "dropout_rate must be in [0, 1)", "model_type 'bart'"):
        assert part in message


def test_unreadable_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read model config"):
        T5Config.from_json(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"d_model": 64,\n "num_heads": }')
    with pytest.raises(ConfigError, match=r"bad.json: not valid JSON \(line 2"):
        T5Config.from_json(bad)
    with pytest.raises(ConfigError, match="no model config 't5-huge'; presets: cpm2-11b"):
        load_preset("t5-huge")


def test_vocab_padding():
    config = T5Config(vocab_size=32100)
    assert config.padded_vocab_size(128, 1) == 32128
    assert config.padded_vocab_size(128, 8) == 32768
    assert config.padded_vocab_size(1, 3) == 32100


def test_tensor_parallel_divisibility_is_checked():
    from megatron.model.t5 import model_parallel_problems
    config = load_preset("t5-v1_1-small")  # 6 heads, d_ff 1024
    assert model_parallel_problems(config, 2) == []
    problems = model_parallel_problems(config, 4)
    assert problems == ["num_heads (6) is not divisible by the tensor-model-parallel size 4"]


def test_cpm2_config_keys(tmp_path):
    """CPM-2's published enc_dec config keys: metadata accepted, switches only at their off value,
    unscaled output init honoured."""
    import json

    from megatron.model.transformer import InitMethods

    base = {"d_model": 64, "d_kv": 16, "d_ff": 128, "num_heads": 4, "num_layers": 2,
            "num_decoder_layers": 2, "vocab_size": 300, "init_method_std": 0.02,
            "max_position_embeddings": 1024, "do_dim_trick": False, "attn_scale": False}
    path = tmp_path / "enc_dec.json"
    path.write_text(json.dumps({**base, "use_scaled_init_for_output_weights": True}))
    scaled = T5Config.from_json(path)
    assert InitMethods(scaled, 2).std("wo") == pytest.approx(0.02 / 2.0)
    path.write_text(json.dumps({**base, "use_scaled_init_for_output_weights": False}))
    assert InitMethods(T5Config.from_json(path), 2).std("wo") == 0.02
    path.write_text(json.dumps({**base, "do_dim_trick": True, "attn_scale": True}))
    with pytest.raises(ConfigError, match="do_dim_trick True.*attn_scale True"):
        T5Config.from_json(path)
