"""Where a NaN started (megatron/training/nan_locator.py): a run started from weights in which
one block's weight is huge overflows in that block; the NaN guard stops it at iteration 1, and
the report names that block's module, in the forward, on the re-run of the failing step and
with --detect-nan-layers on the step itself. The weights are made the way a user makes them:
a Hugging Face folder (transformers' T5ForConditionalGeneration.save_pretrained) converted by
data_tools/convert_checkpoint.py --from hf, loaded with --load --finetune."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from train_workers import base_argv

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
HUGE = "encoder.block.1.layer.1.DenseReluDense.wo"


def env():
    out = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    out.pop("WORLD_SIZE", None)
    return out


@pytest.fixture(scope="module")
def huge_weights(train_data, tmp_path_factory):
    """Our checkpoint of the tiny model whose HUGE weight is 3e38 everywhere (finite in fp32;
    its products with the block's activations are not)."""
    import torch
    import transformers

    root = tmp_path_factory.mktemp("huge")
    tiny = json.loads(Path(train_data.tiny).read_text())
    config = transformers.T5Config(**{k: tiny[k] for k in (
        "vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_decoder_layers",
        "num_heads", "feed_forward_proj", "tie_word_embeddings", "dropout_rate")})
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(config)
    with torch.no_grad():
        model.get_parameter(HUGE + ".weight").fill_(3e38)
    model.save_pretrained(root / "hf")
    done = subprocess.run([sys.executable, str(REPO / "data_tools" / "convert_checkpoint.py"),
                           "--from", "hf", str(root / "hf"), "--to", "megatron",
                           str(root / "ckpt"), "--no-progress"],
                          env=env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return root / "ckpt"


@pytest.mark.parametrize("detect", [False, True], ids=["guard", "detect-nan-layers"])
def test_the_report_names_the_block_with_the_huge_weight(train_data, huge_weights, tmp_path,
                                                         detect):
    log, save = tmp_path / "run.log", tmp_path / "save"
    argv = base_argv(train_data, "--load", str(huge_weights), "--finetune", "--save", str(save),
                     "--log-file", str(log), "--log-interval", "1",
                     *(["--detect-nan-layers"] if detect else []),
                     model=str(huge_weights / "model_config.json"), iters=3)
    done = subprocess.run([sys.executable, "-m", "megatron.pretrain_t5", *argv], cwd=tmp_path,
                          env=env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    want = ("non-finite values first appeared on rank 0 at iteration 1 in the forward output "
            f"of {HUGE} (micro-batch 1 of 2)")
    # the first module whose output is not finite: the block's earlier modules are finite
    assert want + "\n" in log.read_text(), done.stdout[-3000:] + done.stderr[-3000:]
    assert "error: iteration 1: the loss is not finite (seen by rank 0" in done.stderr
    assert want in done.stderr and "stopping without saving" in done.stderr
    assert not list(save.glob("iter_*"))  # nothing saved


@pytest.mark.parametrize("layout", [["--zero-stage", "2"], ["--zero-stage", "3"],
                                    ["--tensor-model-parallel-size", "2"],
                                    ["--pipeline-model-parallel-size", "2"]],
                         ids=["dp2-zero2", "dp2-zero3", "tp2", "pp2"])
def test_two_ranks(train_data, huge_weights, tmp_path, layout):
    """Two processes: with data parallelism (ZeRO-2 and 3: the held update, and a re-run whose
    backward runs no gradient reduction) and with tensor parallelism each rank finds the block and rank
    0's log file has both lines; with a pipeline the log says the locator is not available."""
    from harness import run_workers
    from train_workers import run_pretrain_until_error

    log = tmp_path / "run.log"
    argv = base_argv(train_data, "--load", str(huge_weights), "--finetune", "--log-file",
                     str(log), *layout, model=str(huge_weights / "model_config.json"), iters=3)
    results = run_workers(2, run_pretrain_until_error, [argv], timeout=600)
    errors = [r[0]["error"] for r in results]
    assert all(e.startswith("NonFiniteError: iteration 1: the loss is not finite") for e in errors)
    text = log.read_text()
    if "--pipeline-model-parallel-size" in layout:
        assert "the locator of non-finite values (which module) is not available with a " \
               "pipeline" in text
        return
    for rank in (0, 1):
        want = (f"non-finite values first appeared on rank {rank} at iteration 1 in the forward "
                f"output of {HUGE}")
        assert re.search(re.escape(want) + r"( \(micro-batch 1 of 2\))?\n", text), text[-3000:]
