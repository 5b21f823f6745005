"""convert_checkpoint.py's command line: combinations that cannot run are refused with exit 2
and one line per problem, before anything is read."""

import pytest

from data_tools import convert_checkpoint


@pytest.mark.parametrize("argv,expect", [
    (["--load", "CKPT"], "--to FORMAT OUT is required"),
    (["--from", "hf", "--to", "megatron", "OUT"], "--from hf needs the Hugging Face folder"),
    (["--load", "CKPT", "--to", "xml", "OUT"], "--to xml: not one of hf, megatron, fp32"),
    (["--load", "CKPT", "--to", "hf", "OUT", "--target-tensor-parallel-size", "2"],
     "--target-tensor-parallel-size has effect only with --to megatron"),
    (["--load", "CKPT", "--to", "megatron", "OUT", "--target-pipeline-parallel-size", "0"],
     "--target-pipeline-parallel-size must be >= 1"),
    (["--load", "CKPT", "--to", "fp32", "OUT", "--dtype", "bf16"],
     "--dtype has effect only with --to hf"),
    (["--from", "hf", "DIR", "--to", "hf", "OUT"], "nothing to convert"),
    (["--from", "hf", "DIR", "--to", "megatron", "OUT", "--iteration", "3"],
     "--iteration needs --load"),
    (["--inspect", "CKPT", "--to", "hf", "OUT"], "--to has no effect"),
    (["--load", "CKPT", "--to", "fp32", "OUT", "--weights-only"],
     "--weights-only has effect only with --to megatron"),
    (["--load", "CKPT", "--to", "fp32", "OUT", "--object-storage-retries", "3"],
     "--object-storage-retries has effect only with an s3:// --load / --inspect / --to"),
    (["--load", "s3://b/ckpt", "--to", "fp32", "OUT", "--object-storage-timeout", "0"],
     "--object-storage-timeout 0.0 must be positive"),
    (["--load", "s3://b/ckpt", "--to", "fp32", "s3://b/out"],
     "--to fp32 s3://b/out: --to fp32 takes a local path"),
])
def test_bad_command_lines(argv, expect, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert convert_checkpoint.main(argv) == 2
    err = capsys.readouterr().err
    assert expect in err


def test_an_existing_output_is_refused_without_force(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    argv = ["--load", str(tmp_path / "ckpt"), "--to", "fp32", str(tmp_path / "out")]
    assert convert_checkpoint.main(argv) == 2
    assert "exists; pass --force" in capsys.readouterr().err


def test_load_and_from_exclude_each_other():
    with pytest.raises(SystemExit) as e:
        convert_checkpoint.main(["--load", "A", "--from", "hf", "B", "--to", "hf", "C"])
    assert e.value.code == 2


def test_a_prompt_alone_is_named_not_read_as_damage(tmp_path, capsys):
    """A first prompt-tuning stage's checkpoint (--prompt-tune, the model frozen) holds the
    prompt alone: converting it says so and what to do (not 'missing shared.weight ...
    unexpected prompt.weight'), as for a second stage's prompt."""
    import json

    import torch

    from megatron.model.config import T5Config

    ckpt, base = tmp_path / "prompt", tmp_path / "base"
    folder = ckpt / "iter_0000004"
    folder.mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("4\n")
    config = T5Config(vocab_size=4100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
    torch.save({"module": {"prompt.weight": torch.zeros(6, 32)}},
               folder / "mp_rank_00_model_states.pt")
    meta = {"iteration": 4, "layout": {"tensor_model_parallel_size": 1,
                                       "pipeline_model_parallel_size": 1,
                                       "data_parallel_size": 1, "zero_stage": 0},
            "flags": {"prompt_tune": True, "prompt_length": 6},
            "model": {"config": config.to_dict(), "precision": "fp32",
                      "prompt_base": {"load": str(base), "iteration": 2, "digest": "0" * 64}}}
    (folder / "meta.json").write_text(json.dumps(meta))
    out = tmp_path / "hf"
    assert convert_checkpoint.main(["--load", str(ckpt), "--to", "hf", str(out)]) != 0
    err = capsys.readouterr().err
    assert f"{folder} holds a tuned prompt alone (a --prompt-tune run's checkpoint" in err, err
    assert f"convert its base model instead (--load {base})" in err
    assert f"python -m megatron.generate --load {base} --prompt-load {ckpt}" in err
    assert "missing shared.weight" not in err and not out.exists()


@pytest.mark.parametrize("flag", ["--load", "--inspect", "--from"])
def test_a_missing_or_file_source_is_a_bad_command_line(flag, tmp_path, capsys):
    """Exit 2 as megatron.generate gives for the same mistake (it was 1, a read failure's),
    and a file said to be one."""
    weights = tmp_path / "model.pt"
    weights.write_bytes(b"not a folder")
    for source, said in ((tmp_path / "nothing", "no such folder"),
                         (weights, "is a file: give the checkpoint folder")):
        argv = {"--load": ["--load", str(source)], "--inspect": ["--inspect", str(source)],
                "--from": ["--from", "hf", str(source)]}[flag]
        if flag != "--inspect":
            argv += ["--to", "megatron", str(tmp_path / "out")]
        assert convert_checkpoint.main(argv) == 2
        err = capsys.readouterr().err
        assert f"{source}: {said}" in err or f"{source} {said}" in err, err
        assert not (tmp_path / "out").exists()
