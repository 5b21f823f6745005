"""CPM-2 checkpoints through `convert_checkpoint.py --from cpm2` (megatron/checkpoint/formats/cpm2.py).

Two sources of CPM-2 checkpoints:
- written here from a reference model of ours, at model-parallel sizes 2 and 4, by CPM-2's split
  rules (`write_cpm2`, written from their src/mpu/layers.py `_initialize_affine_weight`: a
  [rows, cols] master cut into per_partition / stride blocks along the split dim, rank r taking
  blocks r, r + P, r + 2P ...): converted to fp32 it is the reference bit for bit, to Hugging Face
  and to our TP=2 model it gives the reference logits;
- written by CPM-2's own code (tests/data/cpm2_checkpoint, MP 1 and 2, see its README): converted,
  our model and transformers give the logits their model gave.
Bad inputs exit 1 with one message and leave nothing behind."""

import json
import random
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch

from data_tools import convert_checkpoint
from megatron.checkpoint.formats import cpm2, cpm2_shards
from megatron.model import T5Config, T5Model
from megatron.model.config import ConfigError
from megatron.model.state_dict import gather_full_state_dict, load_full_state_dict

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "data" / "cpm2_checkpoint"
VOCAB = 96  # divisible by 4 ranks; our model pads it to 128
THEIRS = {"d_model": 16, "d_kv": 4, "d_ff": 24, "num_heads": 4, "num_layers": 2,
          "num_decoder_layers": 2, "dropout_rate": 0.0, "feed_forward_proj": "gated-gelu",
          "init_method_std": 0.02, "layer_norm_epsilon": 1e-6, "max_position_embeddings": 512,
          "use_cache": True, "use_scaled_init_for_output_weights": True, "do_dim_trick": False}
OURS = dict(vocab_size=VOCAB, d_model=16, d_kv=4, d_ff=24, num_layers=2, num_heads=4,
            feed_forward_proj="gated-gelu", tie_word_embeddings=False, dropout_rate=0.0,
            init_method_std=0.02, pad_token_id=5, eos_token_id=7, decoder_start_token_id=1)
ITERATION = 3


# CPM-2's layout, written by their rules ---------------------------------------------------------
def scatter(master, size, rank, dim, stride=1):
    """Rank `rank`'s part of `master` as their _initialize_affine_weight cuts it."""
    per_partition = master.shape[dim] // size
    blocks = torch.split(master, per_partition // stride, dim=dim)
    return torch.cat(blocks[rank::size], dim=dim).clone()


def their_state_dict(full, config, size, rank):
    """Rank `rank`'s EncDecModel.state_dict() for our full state dict `full`."""
    sd = {"word_embeds.weight": scatter(full["shared.weight"], size, rank, 0),
          "lm_head.weight": scatter(full["lm_head.weight"], size, rank, 0)}
    for stack, cross in (("encoder", False), ("decoder", True)):
        sd[f"{stack}.word_embeds.weight"] = sd["word_embeds.weight"]  # one module, listed again
        sd[f"{stack}.final_layernorm.weight"] = full[f"{stack}.final_layer_norm.weight"]
        for i in range(config.num_layers):
            ours, theirs = f"{stack}.block.{i}.layer", f"{stack}.blocks.{i}"
            attn = f"{ours}.0.SelfAttention"
            qkv = torch.cat([full[f"{attn}.{p}.weight"] for p in "qkv"])
            sd[f"{theirs}.self_attn.self_attn.project.weight"] = scatter(qkv, size, rank, 0, 3)
            sd[f"{theirs}.self_attn.self_attn.dense.weight"] = \
                scatter(full[f"{attn}.o.weight"], size, rank, 1)
            if i == 0:
                sd[f"{theirs}.self_attn.self_attn.relative_attention_bias.weight"] = scatter(
                    full[f"{attn}.relative_attention_bias.weight"], size, rank, 1)
            sd[f"{theirs}.self_attn.layer_norm.weight"] = full[f"{ours}.0.layer_norm.weight"]
            if cross:
                x = f"{ours}.1.EncDecAttention"
                kv = torch.cat([full[f"{x}.k.weight"], full[f"{x}.v.weight"]])
                sd[f"{theirs}.cross_attn.cross_attn.project_q.weight"] = \
                    scatter(full[f"{x}.q.weight"], size, rank, 0)
                sd[f"{theirs}.cross_attn.cross_attn.project_kv.weight"] = \
                    scatter(kv, size, rank, 0, 2)
                sd[f"{theirs}.cross_attn.cross_attn.dense.weight"] = \
                    scatter(full[f"{x}.o.weight"], size, rank, 1)
                sd[f"{theirs}.cross_attn.layer_norm.weight"] = full[f"{ours}.1.layer_norm.weight"]
            ff = f"{ours}.{2 if cross else 1}"
            for proj in ("wi_0", "wi_1", "wo"):
                sd[f"{theirs}.ff.dense_relu_dense.{proj}.weight"] = scatter(
                    full[f"{ff}.DenseReluDense.{proj}.weight"], size, rank,
                    1 if proj == "wo" else 0)
            sd[f"{theirs}.ff.layer_norm.weight"] = full[f"{ff}.layer_norm.weight"]
    return sd


def write_cpm2(root, full, size, dtype=torch.float32):
    """root/latest_checkpointed_iteration.txt, root/3/mp_rank_XX_model_states.pt as CPM-2's
    DeepSpeed save writes them: 'module' beside DeepSpeed's keys and CPM-2's client state."""
    config = T5Config(**OURS)
    folder = root / str(ITERATION)
    folder.mkdir(parents=True)
    for rank in range(size):
        module = {k: v.to(dtype) for k, v in their_state_dict(full, config, size, rank).items()}
        for stack in ("encoder", "decoder"):  # keep the copies one tensor, as torch.save does
            module[f"{stack}.word_embeds.weight"] = module["word_embeds.weight"]
        torch.save({"module": module, "optimizer": None, "lr_scheduler": {"start_lr": 1e-3},
                    "csr_tensor_module_names": set(), "skipped_steps": 0,
                    "global_steps": ITERATION, "dp_world_size": 1, "mp_world_size": size,
                    "iteration": ITERATION, "random_rng_state": random.getstate(),
                    "np_rng_state": np.random.get_state(), "torch_rng_state":
                    torch.get_rng_state(), "rng_tracker_states": {}},
                   folder / f"mp_rank_{rank:02d}_model_states.pt")
    (root / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    return root


def spread(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.mul_(torch.empty(param.shape).uniform_(0.5, 1.5, generator=g))
    return module


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(3)
    model = spread(T5Model(T5Config(**OURS)), 3).eval()
    return model, gather_full_state_dict(model)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Their model config (their keys) and a vocab.txt of VOCAB tokens, CPM-2's specials first."""
    folder = tmp_path_factory.mktemp("cpm2_files")
    (folder / "enc_dec_config.json").write_text(json.dumps(THEIRS))
    tokens = (FIXTURE / "vocab.txt").read_text(encoding="utf-8").split("\n")[:58]
    tokens += [f"<s_{i}>" for i in range(VOCAB - len(tokens))]
    (folder / "vocab.txt").write_text("\n".join(tokens) + "\n", encoding="utf-8")
    return folder


def batch(vocab=VOCAB):
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, vocab, (2, 11), generator=g), torch.randint(0, vocab, (2, 5),
                                                                         generator=g)


def convert(*argv):
    return convert_checkpoint.main([*map(str, argv), "--no-progress"])


def read_fp32(out):
    got = {}
    for f in sorted(out.glob("iter_*/*.safetensors")):
        got.update(safetensors.torch.load_file(f))
    return got


def logits_of(full, config, enc, dec):
    model = T5Model(config, make_vocab_size_divisible_by=1).eval()
    load_full_state_dict(model, full)
    with torch.no_grad():
        return model(enc, dec).logits


def assert_close(got, want):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


# Conversions ------------------------------------------------------------------------------------
@pytest.mark.parametrize("size,dtype", [(2, torch.float32), (4, torch.float32),
                                        (4, torch.float16)])
def test_to_fp32_is_the_reference_bit_for_bit(reference, files, tmp_path, size, dtype):
    """fp16 is what CPM-2 saves: widened exactly."""
    _, full = reference
    src = write_cpm2(tmp_path / "cpm2", full, size, dtype)
    out = tmp_path / "fp32"
    assert convert("--from", "cpm2", src, "--model-config", files / "enc_dec_config.json",
                   "--to", "fp32", out) == 0
    got = read_fp32(out)
    assert list(got) == list(full)  # our model's order
    for name, tensor in full.items():
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], tensor.to(dtype).float()), name
    meta = json.loads((out / f"iter_{ITERATION:07d}" / "meta.json").read_text())
    assert meta["source"]["format"] == "cpm2" and meta["source"]["model_parallel_size"] == size


def test_to_hf_gives_the_reference_logits(reference, files, tmp_path):
    from transformers import T5ForConditionalGeneration

    model, full = reference
    src = write_cpm2(tmp_path / "cpm2", full, 4, torch.float16)
    out = tmp_path / "hf"
    assert convert("--from", "cpm2", src, "--model-config", files / "enc_dec_config.json",
                   "--tokenizer-path", files, "--to", "hf", out) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md", "config.json", "generation_config.json", "model.safetensors", "vocab.txt"]
    assert (out / "vocab.txt").read_bytes() == (files / "vocab.txt").read_bytes()
    readme = (out / "README.md").read_text(encoding="utf-8")
    assert "jieba" in readme and "megatron.data.tokenizers.cpm2_tokenizer" in readme
    assert "- padding: 5 (`<pad>`)" in readme and "`<s_0>` = 58" in readme
    hf = T5ForConditionalGeneration.from_pretrained(out, attn_implementation="eager").eval()
    assert hf.lm_head.weight is not hf.shared.weight and hf.dtype == torch.float32
    assert (hf.config.decoder_start_token_id, hf.config.pad_token_id,
            hf.config.eos_token_id) == (1, 5, 7)
    enc, dec = batch()
    with torch.no_grad():
        want = logits_of({k: v.half().float() for k, v in full.items()}, model.config, enc, dec)
        got = hf(input_ids=enc, decoder_input_ids=dec).logits
    assert_close(got, want[..., :VOCAB])


def test_to_megatron_writes_the_reference_for_any_layout(reference, files, tmp_path):
    _, full = reference
    src = write_cpm2(tmp_path / "cpm2", full, 4)
    out = tmp_path / "ours"
    assert convert("--from", "cpm2", src, "--model-config", files / "enc_dec_config.json",
                   "--tokenizer-path", files / "vocab.txt", "--to", "megatron", out,
                   "--target-tensor-parallel-size", "2") == 0
    got = read_fp32(out)
    assert got.keys() == full.keys() and all(torch.equal(got[k], full[k]) for k in full)
    written = T5Config.from_json(out / "model_config.json")
    assert written == T5Config(**OURS, init_method="cpm2")
    meta = json.loads((out / f"iter_{ITERATION:07d}" / "meta.json").read_text())
    assert meta["layout"]["tensor_model_parallel_size"] == 2


def tp_logits(rank, world_size, folder, fields, enc, dec):
    """The trainer's model at TP=world_size loading a weights checkpoint as the trainer does
    (weights.load_into: each rank its slice), its gathered logits."""
    from megatron import parallel_state
    from megatron.checkpoint.formats.weights import WeightsReader, load_into
    from megatron.tensor_parallel import gather_from_tensor_model_parallel_region

    parallel_state.initialize_model_parallel(world_size, 1)
    model = T5Model(T5Config(**fields)).eval()
    problems = load_into(model, {n: n for n, _ in model.named_parameters()},
                         WeightsReader(folder), fields["vocab_size"], rank, world_size)
    assert not problems, problems
    with torch.no_grad():
        logits = gather_from_tensor_model_parallel_region(model(enc, dec).logits,
                                                          model.tensor_parallel)
    return logits[..., :fields["vocab_size"]]


@pytest.mark.slow
def test_ours_at_tp2_gives_the_reference_logits(reference, files, tmp_path):
    sys.path.insert(0, str(REPO / "tests" / "distributed"))
    from harness import run_workers

    model, full = reference
    src = write_cpm2(tmp_path / "cpm2", full, 4)
    out = tmp_path / "ours"
    assert convert("--from", "cpm2", src, "--model-config", files / "enc_dec_config.json",
                   "--to", "megatron", out, "--target-tensor-parallel-size", "2") == 0
    enc, dec = batch()
    got = run_workers(2, tp_logits, out / f"iter_{ITERATION:07d}", OURS, enc, dec,
                      timeout=300)[0]
    with torch.no_grad():
        want = model(enc, dec).logits[..., :VOCAB]
    assert_close(got, want)


# Their own code's checkpoints --------------------------------------------------------------------
def their_run(size):
    return torch.load(FIXTURE / f"mp{size}" / "logits.pt", weights_only=True)


@pytest.mark.parametrize("size", [1, 2])
def test_their_checkpoints_give_their_logits(size, tmp_path, capsys):
    out = tmp_path / "fp32"
    assert convert("--from", "cpm2", FIXTURE / f"mp{size}", "--model-config",
                   FIXTURE / "config.json", "--tokenizer-path", FIXTURE, "--to", "fp32",
                   out) == 0
    # their config says "relu"; their code builds gated GELU regardless, and so do we
    assert "feed_forward_proj 'relu' is not read by CPM-2's code" in capsys.readouterr().err
    meta = json.loads((out / "iter_0000007" / "meta.json").read_text())
    config = T5Config(**meta["model"]["config"])
    run = their_run(size)
    got = logits_of(read_fp32(out), config, run["enc_input_ids"], run["dec_input_ids"])
    assert_close(got[..., :config.vocab_size], run["logits"])


def test_their_checkpoint_in_transformers_gives_their_logits(tmp_path):
    from transformers import T5ForConditionalGeneration

    out = tmp_path / "hf"
    assert convert("--from", "cpm2", FIXTURE / "mp2", "--model-config", FIXTURE / "config.json",
                   "--tokenizer-path", FIXTURE, "--to", "hf", out) == 0
    hf = T5ForConditionalGeneration.from_pretrained(out, attn_implementation="eager").eval()
    run = their_run(2)
    with torch.no_grad():
        got = hf(input_ids=run["enc_input_ids"], decoder_input_ids=run["dec_input_ids"]).logits
    assert_close(got, run["logits"])


def test_their_fixture_tells_a_wrong_unstriding_apart():
    """Joining the fused q/k/v as one contiguous split (not stride 3) gives other logits: the
    fixture checks the layout, not only the names."""
    checkpoint = cpm2_shards.CPM2Checkpoint.open(FIXTURE / "mp2")
    config, _ = cpm2.read_config(FIXTURE / "config.json", checkpoint.vocab_rows())
    full = dict(checkpoint.tensors(config))
    for name in [n for n in full if n.endswith("SelfAttention.q.weight")]:
        theirs = cpm2_shards.source_table(config)[name][0]
        q, k, v = torch.cat([m[theirs] for m in checkpoint.modules]).chunk(3)
        stem = name[:-len("q.weight")]
        full.update({stem + "q.weight": q, stem + "k.weight": k, stem + "v.weight": v})
    run = their_run(2)
    wrong = logits_of(full, config, run["enc_input_ids"], run["dec_input_ids"])
    assert (wrong - run["logits"]).abs().max() > 0.1


# Configs ------------------------------------------------------------------------------------------
def test_their_config_maps_to_cpm2s_architecture(tmp_path):
    """What their code builds, whatever their JSON says: gated GELU, num_layers decoder blocks,
    untied unscaled head, max distance 128."""
    path = tmp_path / "enc_dec_xlarge_config.json"
    path.write_text(json.dumps({**THEIRS, "feed_forward_proj": "relu",
                                "num_decoder_layers": 3}))
    config, notes = cpm2.read_config(path, 26240)
    assert (config.feed_forward_proj, config.num_layers, config.num_decoder_layers) == \
        ("gated-gelu", 2, 2)
    assert not config.tie_word_embeddings and not config.scale_decoder_outputs
    assert config.relative_attention_max_distance == 128 and config.vocab_size == 26240
    assert config.init_method == "cpm2" and config.init_method_std == 0.02
    assert len(notes) == 2 and "always builds gated GELU" in notes[0] \
        and "num_layers (2) blocks" in notes[1]


def test_our_config_must_be_cpm2s_architecture(tmp_path):
    config, notes = cpm2.read_config(REPO / "configs" / "model" / "cpm2-11b.json", 26240)
    assert config.d_model == 4096 and notes == []
    path = tmp_path / "tied.json"
    path.write_text(json.dumps({**OURS, "tie_word_embeddings": True}))
    with pytest.raises(ConfigError, match="tie_word_embeddings is True, CPM-2's model has False"):
        cpm2.read_config(path, VOCAB)
    with pytest.raises(ConfigError, match="vocab_size is 96, CPM-2's model has 100"):
        cpm2.read_config(_write(tmp_path, OURS), 100)
    path.write_text(json.dumps({**THEIRS, "num_head": 4}))
    with pytest.raises(ConfigError, match="EncDecConfig does not have: num_head"):
        cpm2.read_config(path, VOCAB)


def _write(folder, values):
    path = folder / "config.json"
    path.write_text(json.dumps(values))
    return path


# Bad inputs --------------------------------------------------------------------------------------
def refused(capsys, tmp_path, *argv, code=1):
    """Run the command to tmp_path/out: nothing written; the one error line (exit 1) or the
    command line's problems (exit 2)."""
    out = tmp_path / "out"
    assert convert(*argv, "--to", "fp32", out) == code
    assert not out.exists() and not out.with_name("out.tmp").exists()
    err = capsys.readouterr().err
    if code == 2:  # the command line: one line per problem under one heading
        return err
    errors = [line for line in err.splitlines() if line.startswith("error")]
    assert len(errors) == 1, err
    return errors[0]


@pytest.fixture
def cpm2_ckpt(reference, tmp_path):
    return write_cpm2(tmp_path / "cpm2", reference[1], 4)


def test_a_missing_shard_is_named(cpm2_ckpt, files, tmp_path, capsys):
    config = files / "enc_dec_config.json"
    (cpm2_ckpt / "3" / "mp_rank_02_model_states.pt").unlink()
    error = refused(capsys, tmp_path, "--from", "cpm2", cpm2_ckpt, "--model-config", config)
    assert "3/mp_rank_02_model_states.pt: missing" in error and "incomplete" in error
    (cpm2_ckpt / "3" / "mp_rank_03_model_states.pt").unlink()  # the last: the size is recorded
    error = refused(capsys, tmp_path, "--from", "cpm2", cpm2_ckpt, "--model-config", config)
    assert "mp_rank_02_model_states.pt: missing (and 1 more rank(s)); mp_rank_00_model_states" \
           ".pt records model-parallel size 4" in error


def test_a_missing_tracker_asks_for_the_iteration(cpm2_ckpt, files, tmp_path, capsys):
    config = files / "enc_dec_config.json"
    (cpm2_ckpt / "latest_checkpointed_iteration.txt").unlink()
    error = refused(capsys, tmp_path, "--from", "cpm2", cpm2_ckpt, "--model-config", config)
    assert "latest_checkpointed_iteration.txt: missing" in error and "--iteration N" in error
    error = refused(capsys, tmp_path, "--from", "cpm2", cpm2_ckpt, "--model-config", config,
                    "--iteration", "5")
    assert "/5: missing; iteration folders in" in error and ": 3" in error
    assert convert("--from", "cpm2", cpm2_ckpt, "--model-config", config, "--iteration", "3",
                   "--to", "fp32", tmp_path / "out") == 0


@pytest.mark.parametrize("change,expect", [
    ({"d_ff": 32}, "ff.dense_relu_dense.wi_0.weight has shape (6, 16), "),
    ({"num_layers": 3}, "missing tensors: encoder.blocks.2."),
    ({"num_heads": 8, "d_kv": 2}, "relative_attention_bias.weight has shape (32, 1)"),
])
def test_a_config_that_does_not_fit_the_tensors(cpm2_ckpt, tmp_path, capsys, change, expect):
    config = _write(tmp_path, {**THEIRS, **change})
    error = refused(capsys, tmp_path, "--from", "cpm2", cpm2_ckpt, "--model-config", config)
    assert "mp_rank_00_model_states.pt: " in error and expect in error
    assert "is --model-config the run's?" in error


def test_a_vocabulary_of_another_size(cpm2_ckpt, files, tmp_path, capsys):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join((files / "vocab.txt").read_text().split("\n")[:50]) + "\n")
    error = refused(capsys, tmp_path, "--from", "cpm2", cpm2_ckpt, "--model-config",
                    files / "enc_dec_config.json", "--tokenizer-path", vocab)
    assert "vocab.txt: 50 tokens, the checkpoint's vocabulary has 96 rows" in error


def test_other_formats_are_named(reference, files, tmp_path, capsys):
    from megatron.checkpoint.formats.hf import write_hf_folder

    config = files / "enc_dec_config.json"
    hf = write_hf_folder(tmp_path / "hf", T5Config(**OURS), reference[1].items())
    error = refused(capsys, tmp_path, "--from", "cpm2", hf, "--model-config", config)
    assert "not a CPM-2 checkpoint: it is a Hugging Face model folder; convert it with " \
           "--from hf" in error
    ours = tmp_path / "ours"
    (ours / "iter_0000002").mkdir(parents=True)
    (ours / "iter_0000002" / "meta.json").write_text("{}")
    (ours / "latest_checkpointed_iteration.txt").write_text("2")
    error = refused(capsys, tmp_path, "--from", "cpm2", ours, "--model-config", config)
    assert "it is a checkpoint of our trainer; convert it with --load" in error
    empty = tmp_path / "empty"
    empty.mkdir()
    error = refused(capsys, tmp_path, "--from", "cpm2", empty, "--model-config", config)
    assert "latest_checkpointed_iteration.txt: missing" in error


def test_a_file_that_is_not_deepspeeds(cpm2_ckpt, files, tmp_path, capsys):
    shard = cpm2_ckpt / "3" / "mp_rank_01_model_states.pt"
    torch.save({"model": {}}, shard)
    error = refused(capsys, tmp_path, "--from", "cpm2", cpm2_ckpt, "--model-config",
                    files / "enc_dec_config.json")
    assert "mp_rank_01_model_states.pt: no 'module' state dict (it holds model)" in error
    shard.write_bytes(b"PK\x03\x04 truncated")
    error = refused(capsys, tmp_path, "--from", "cpm2", cpm2_ckpt, "--model-config",
                    files / "enc_dec_config.json")
    assert "mp_rank_01_model_states.pt: cannot be read" in error


@pytest.mark.parametrize("argv,expect", [
    (["--from", "cpm2", "DIR"], "--from cpm2 needs --model-config FILE"),
    (["--from", "cpm2"], "--from cpm2 needs the checkpoint folder"),
    (["--from", "hf", "DIR", "--model-config", "c.json"],
     "--model-config has effect only with --from cpm2"),
    (["--load", "DIR", "--tokenizer-path", "bpe_cn"],
     "--tokenizer-path has effect only with --from cpm2"),
    (["--from", "cpm2", "DIR", "--model-config", "nowhere.json", "--tokenizer-path", "bpe"],
     "--model-config nowhere.json: no such file\n  - --tokenizer-path bpe: no such file or folder"),
])
def test_bad_command_lines(argv, expect, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert expect in refused(capsys, tmp_path, *argv, code=2)


def test_copies_of_the_embedding_must_be_equal(reference, files, tmp_path, capsys):
    src = write_cpm2(tmp_path / "cpm2", reference[1], 2)
    module = their_state_dict(reference[1], T5Config(**OURS), 2, 1)
    module["decoder.word_embeds.weight"] = module["word_embeds.weight"] + 1
    torch.save({"module": module, "mp_world_size": 2}, src / "3" / "mp_rank_01_model_states.pt")
    error = refused(capsys, tmp_path, "--from", "cpm2", src, "--model-config",
                    files / "enc_dec_config.json")
    assert "decoder.word_embeds.weight differs from word_embeds.weight" in error
    shutil.rmtree(src)
