"""megatron/checkpoint/formats/deepspeed.py without processes: a one-process checkpoint in DeepSpeed's
file layout made here, the tensor-parallel split rules, and every kind of bad input (each error
names the file). Real runs in every layout: tests/training/test_checkpoint_read_layouts.py."""

import argparse
import json

import pytest
import torch

from megatron.checkpoint.formats import deepspeed as reader
from megatron.checkpoint.formats import deepspeed_files
from megatron.checkpoint.formats.deepspeed import (
    ALLOWED_GLOBALS,
    CheckpointReadError,
    describe,
    find_iteration,
    iter_full_tensors,
    model_config,
    read_meta,
)
from megatron.model.config import T5Config
from megatron.model.meta import parameter_splits
from megatron.model.t5 import T5Model

CONFIG = dict(vocab_size=100, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2,
              feed_forward_proj="gated-gelu", tie_word_embeddings=False, dropout_rate=0.0)
DIVISIBLE = 8  # 100 rows padded to 104


def write_checkpoint(root, precision="fp32", iteration=3, model=True):
    """A one-process ZeRO-0 checkpoint as the trainer writes it; returns the full state dict."""
    config = T5Config(**CONFIG)
    torch.manual_seed(0)
    net = T5Model(config, DIVISIBLE)
    dtype = {"fp32": torch.float32, "fp16": torch.float16}[precision]
    state = {k: v.to(dtype) for k, v in net.state_dict().items()}
    folder = root / f"iter_{iteration:07d}"
    folder.mkdir(parents=True)
    torch.save({"module": state, "buffer_names": [], "optimizer": None, "param_shapes": None,
                "ds_version": "0.19.8", "iteration": iteration},
               folder / "mp_rank_00_model_states.pt")
    meta = {"iteration": iteration, "consumed_samples": 12,
            "layout": {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
                       "data_parallel_size": 1, "zero_stage": 0},
            "flags": {"precision": precision, "model_config": "configs/model/tiny.json",
                      "make_vocab_size_divisible_by": DIVISIBLE}}
    if model:
        meta["model"] = {"config": config.to_dict(), "make_vocab_size_divisible_by": DIVISIBLE,
                         "precision": precision}
    (folder / "meta.json").write_text(json.dumps(meta))
    (root / "latest_checkpointed_iteration.txt").write_text(f"{iteration}\n")
    return {k: v[:100] if k in ("shared.weight", "lm_head.weight") else v
            for k, v in state.items()}


@pytest.fixture
def ckpt(tmp_path):
    root = tmp_path / "ckpt"
    return root, write_checkpoint(root)


def test_a_one_process_checkpoint_reads_as_its_unpadded_module(ckpt):
    root, want = ckpt
    for source in ("master", "weights"):
        got = list(iter_full_tensors(find_iteration(root), source))
        assert [name for name, _ in got] == list(want)
        for name, tensor in got:
            assert torch.equal(tensor, want[name]), name
    with pytest.raises(ValueError, match="source must be one of"):
        next(iter_full_tensors(find_iteration(root), "fp32"))


def test_split_rules_are_the_layers_own():
    """Column-parallel (dim 0): q, k, v, wi_*, the vocabulary; row-parallel (dim 1): o, wo and
    the bias table's heads; norms replicated. Shapes are full and unpadded."""
    params = parameter_splits(T5Config(**CONFIG))
    prefix = "encoder.block.0.layer."
    assert params["shared.weight"] == ((100, 8), (0, 1))
    assert params["lm_head.weight"] == ((100, 8), (0, 1))
    assert params[prefix + "0.SelfAttention.q.weight"] == ((8, 8), (0, 1))
    assert params[prefix + "0.SelfAttention.o.weight"] == ((8, 8), (1, 1))
    assert params[prefix + "0.SelfAttention.relative_attention_bias.weight"] == ((32, 2), (1, 1))
    assert params[prefix + "1.DenseReluDense.wi_1.weight"] == ((16, 8), (0, 1))
    assert params[prefix + "1.DenseReluDense.wo.weight"] == ((8, 16), (1, 1))
    assert params[prefix + "1.layer_norm.weight"] == ((8,), None)
    assert params["decoder.final_layer_norm.weight"] == ((8,), None)


def test_find_iteration(ckpt):
    root, _ = ckpt
    assert find_iteration(root) == root / "iter_0000003"
    assert find_iteration(str(root), 3) == root / "iter_0000003"
    assert find_iteration(root / "iter_0000003") == root / "iter_0000003"
    with pytest.raises(CheckpointReadError, match=r"iter_0000007: missing; iterations in .*: "
                                                  r"iter_0000003"):
        find_iteration(root, 7)
    with pytest.raises(CheckpointReadError, match="no such checkpoint folder"):
        find_iteration(root / "nowhere")


def test_tracker_problems_name_the_tracker(ckpt):
    root, _ = ckpt
    tracker = root / "latest_checkpointed_iteration.txt"
    tracker.write_text("iter_3\n")
    with pytest.raises(CheckpointReadError, match=r"latest_checkpointed_iteration.txt holds "
                                                  r"'iter_3', not an iteration number"):
        find_iteration(root)
    tracker.write_text("release")
    with pytest.raises(CheckpointReadError, match="Megatron-LM release"):
        find_iteration(root)
    tracker.write_text("9\n")
    with pytest.raises(CheckpointReadError, match=r"iter_0000009: missing \(latest_checkpointed"
                                                  r"_iteration.txt names it\)"):
        find_iteration(root)
    tracker.unlink()
    with pytest.raises(CheckpointReadError, match=r"latest_checkpointed_iteration.txt: missing.*"
                                                  r"it has iter_0000003: pass the iteration"):
        find_iteration(root)
    assert find_iteration(root, 3) == root / "iter_0000003"


def test_folders_of_other_tools_are_recognised(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointReadError, match="Hugging Face model folder"):
        find_iteration(hf)
    lm = tmp_path / "megatron_lm"
    (lm / "iter_0000010" / "mp_rank_00").mkdir(parents=True)
    (lm / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"")
    (lm / "latest_checkpointed_iteration.txt").write_text("10")
    with pytest.raises(CheckpointReadError, match=r"meta.json: missing, so .* not an iteration "
                                                  r"folder written by our trainer.*Megatron-LM"):
        read_meta(find_iteration(lm))


def test_meta_json_problems(ckpt):
    root, _ = ckpt
    meta_path = root / "iter_0000003" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text("{not json")
    with pytest.raises(CheckpointReadError, match="meta.json: unreadable"):
        read_meta(root / "iter_0000003")
    meta_path.write_text(json.dumps({"iteration": 3}))
    with pytest.raises(CheckpointReadError, match="no 'layout'"):
        read_meta(root / "iter_0000003")
    gpt = {"model_type": "gpt2", "n_layer": 12, "vocab_size": 50257}
    meta_path.write_text(json.dumps({**meta, "model": {**meta["model"], "config": gpt}}))
    with pytest.raises(CheckpointReadError, match=r"meta.json \(model.config\): model_type "
                                                  r"'gpt2' is not a T5 model"):
        next(iter_full_tensors(root / "iter_0000003"))


def test_a_checkpoint_from_before_meta_recorded_the_model(tmp_path):
    root = tmp_path / "old"
    write_checkpoint(root, model=False)
    folder = find_iteration(root)
    with pytest.raises(CheckpointReadError, match=r"no 'model' section.*--model-config "
                                                  r"configs/model/tiny.json"):
        model_config(read_meta(folder), folder / "meta.json")
    with pytest.raises(CheckpointReadError, match="no 'model' section"):
        next(iter_full_tensors(folder))
    info = describe(folder)  # --inspect still shows what there is
    assert info["parameters"] is None and "no 'model' section" in info["problems"][0]
    assert info["layout"]["zero_stage"] == 0


def test_a_truncated_file_is_named(ckpt):
    root, _ = ckpt
    path = root / "iter_0000003" / "mp_rank_00_model_states.pt"
    path.write_bytes(path.read_bytes()[:-200])
    with pytest.raises(CheckpointReadError, match=r"mp_rank_00_model_states.pt: cannot be read "
                                                  r".*truncated or damaged"):
        next(iter_full_tensors(root / "iter_0000003"))
    path.unlink()
    with pytest.raises(CheckpointReadError, match="mp_rank_00_model_states.pt: missing"):
        next(iter_full_tensors(root / "iter_0000003"))


def test_only_the_allowed_objects_are_unpickled(ckpt):
    """Megatron-LM style pickles (an argparse.Namespace of the run's args) are refused with the
    file and the class named; nothing is ever loaded with weights_only=False."""
    root, _ = ckpt
    path = root / "iter_0000003" / "mp_rank_00_model_states.pt"
    state = torch.load(path, weights_only=True)
    torch.save({**state, "args": argparse.Namespace(lr=1.0)}, path)
    with pytest.raises(CheckpointReadError, match=r"mp_rank_00_model_states.pt: holds "
                                                  r"argparse.Namespace, which this reader does "
                                                  r"not load"):
        next(iter_full_tensors(root / "iter_0000003"))


def test_allowed_globals_are_deepspeeds_classes():
    classes = deepspeed_files.allowed_globals()
    assert [f"{c.__module__}.{c.__qualname__}" for c in classes] == list(ALLOWED_GLOBALS)


def test_fp16_masters_of_zero_0_are_not_guessed(tmp_path):
    root = tmp_path / "fp16"
    want = write_checkpoint(root, precision="fp16")
    with pytest.raises(CheckpointReadError, match="source='weights'"):
        next(iter_full_tensors(find_iteration(root)))
    got = dict(iter_full_tensors(find_iteration(root), "weights"))
    assert all(torch.equal(got[k], v) and v.dtype == torch.float16 for k, v in want.items())


def test_a_weights_checkpoint_is_read_too(ckpt, tmp_path):
    """What the conversion tool writes (megatron/checkpoint/formats/weights.py) reads back as it is."""
    from megatron.checkpoint.formats.weights import write_weights_checkpoint

    root, want = ckpt
    model = read_meta(find_iteration(root))["model"]
    out = write_weights_checkpoint(tmp_path / "weights", iter_full_tensors(find_iteration(root)),
                                   model)
    got = dict(iter_full_tensors(find_iteration(out)))
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], v) for k, v in want.items())
    assert describe(find_iteration(out))["format"] == "weights"


def test_describe(ckpt):
    root, want = ckpt
    info = describe(find_iteration(root))
    assert info["iteration"] == 3 and info["consumed_samples"] == 12 and not info["problems"]
    assert info["format"] == "deepspeed" and info["precision"] == "fp32"
    assert info["parameters"] == sum(t.numel() for t in want.values())
    assert info["dtypes"] == {"weights": "float32", "master": "float32"}
    assert info["optimizer_states"] is False  # this file has none
    assert {f["name"] for f in info["files"]} == {"meta.json", "mp_rank_00_model_states.pt"}
    json.dumps(info)  # plain JSON for --inspect


def test_flat_reads_ranges_across_parts():
    flat = deepspeed_files.Flat([torch.arange(0, 3.0), torch.arange(3, 3.0), torch.arange(3, 10.0)])
    assert len(flat) == 10
    assert flat.read(2, 5).tolist() == [2, 3, 4, 5, 6]
    assert flat.read(0, 0).numel() == 0
    with pytest.raises(IndexError):
        flat.read(8, 5)


def test_tracker_and_folder_names_are_the_trainers():
    from megatron.checkpoint import layout
    from megatron.checkpoint.io import checkpointing

    # the trainer writes the tracker through checkpoint/layout.py (io/saver.py); Megatron's name
    assert reader.TRACKER == layout.TRACKER == "latest_checkpointed_iteration.txt"
    assert checkpointing.tag_for(3) == "iter_0000003"
