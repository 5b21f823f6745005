"""Commands whose stdout is one JSON document (`python -m megatron.plan --json`,
`convert_checkpoint.py --inspect`): the whole stdout of the real process parses, and DeepSpeed's
log line is on stderr, moved, not silenced. And megatron/stdout.py's redirection itself."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import torch

from megatron.stdout import logs_to_stderr

REPO = Path(__file__).resolve().parents[2]
# What DeepSpeed logs on import where it finds no accelerator (real_accelerator.py).
DEEPSPEED_LINE = "Setting accelerator to CPU"


def run(*argv):
    # No visible CUDA device and no DS_ACCELERATOR: DeepSpeed logs its choice on every machine.
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run([sys.executable, *map(str, argv)], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc


def test_plan_json_is_the_whole_stdout():
    argv = ["-m", "megatron.plan", "--model-config", "t5-small", "--global-batch-size", "8",
            "--cluster", "1x2xH100-80GB", "--top", "2"]
    proc = run(*argv, "--json")
    layouts = json.loads(proc.stdout)
    assert [entry["rank"] for entry in layouts] == [1, 2]
    assert DEEPSPEED_LINE in proc.stderr
    text = run(*argv)  # the text report is stdout's one document as well
    assert text.stdout.startswith("plan: t5-small,") and "\n#1 " in text.stdout
    assert DEEPSPEED_LINE not in text.stdout and DEEPSPEED_LINE in text.stderr


def test_convert_inspect_json_is_the_whole_stdout(tmp_path):
    from megatron.model.config import T5Config
    from megatron.model.t5 import T5Model

    config = T5Config(vocab_size=100, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2,
                      feed_forward_proj="gated-gelu", tie_word_embeddings=False)
    folder = tmp_path / "ckpt" / "iter_0000003"
    folder.mkdir(parents=True)
    torch.save({"module": T5Model(config, 8).state_dict(), "buffer_names": [],
                "optimizer": None, "param_shapes": None, "ds_version": "0.19.8",
                "iteration": 3}, folder / "mp_rank_00_model_states.pt")
    layout = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
              "data_parallel_size": 1, "zero_stage": 0}
    (folder / "meta.json").write_text(json.dumps({
        "iteration": 3, "layout": layout, "flags": {"precision": "fp32"},
        "model": {"config": config.to_dict(), "make_vocab_size_divisible_by": 8,
                  "precision": "fp32"}}))
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("3\n")
    proc = run("data_tools/convert_checkpoint.py", "--inspect", tmp_path / "ckpt")
    info = json.loads(proc.stdout)
    assert info["iteration"] == 3 and info["format"] == "deepspeed" and not info["problems"]
    assert DEEPSPEED_LINE in proc.stderr


def test_logs_to_stderr_moves_prints_and_handlers_and_puts_them_back(capsys):
    logger = logging.getLogger("test_stdout.before")
    logger.propagate = False
    before = logging.StreamHandler(sys.stdout)  # bound to stdout as DeepSpeed's handler is
    logger.addHandler(before)
    try:
        with logs_to_stderr():
            print("printed inside")
            logger.warning("logged inside")
            made_inside = logging.StreamHandler(sys.stdout)  # a library imported here
            logger.addHandler(made_inside)
        logger.removeHandler(made_inside)
        out, err = capsys.readouterr()
        assert out == "" and err == "printed inside\nlogged inside\n"
        assert made_inside.stream is sys.stderr  # it stays there
        logger.warning("logged after")
        assert capsys.readouterr() == ("logged after\n", "")
    finally:
        logger.removeHandler(before)
