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
    # said once (stderr), and kept in the log file
    assert (done.stdout + done.stderr).count("error: iteration 1:") == 1
    assert "error: iteration 1: the loss is not finite" in log.read_text()
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


def step_then_rerun(rank, world_size, argv):
    """One real DataParallelStep (the entry point's builder) at learning rate 0, then its
    re-run by locate_nonfinite: each pass's micro-batch losses, from a forward hook."""
    from megatron import parallel_state
    from megatron.arguments import parse_args
    from megatron.initialize import initialize_distributed, set_seeds
    from megatron.pretrain_t5 import build_step
    from megatron.training.loaders import build_data
    from megatron.training.metrics import MetricsWriter
    from megatron.training.watchdog import NoWatchdog

    config = parse_args(argv, env=os.environ)
    initialize_distributed(config.runtime, config.parallel)
    try:
        set_seeds(config.runtime.seed, config.runtime.device_type)
        step = build_step(config, NoWatchdog(), MetricsWriter(None, None, enabled=False))
        step.watch_nonfinite()
        losses = []
        step.engine.module.register_forward_hook(lambda m, i, out: losses.append(float(out.loss)))
        train, _, _ = build_data(config.data, config.batch, config.runtime.device_type, 0)
        step.step(iter(train), 0.0)
        stepped = list(losses)
        losses.clear()
        finding, how = step.locate_nonfinite()
        return stepped, losses, finding, how
    finally:
        parallel_state.destroy_model_parallel()


def test_the_rerun_draws_the_steps_dropout_masks(train_data):
    """Dropout 0.1 and a learning rate of 0 (the weights stay): the re-run's losses are the
    step's, bit for bit, because the random generators are set back to the step's start (with
    fresh masks they differ in the third digit)."""
    from harness import run_workers

    argv = base_argv(train_data, model=train_data.tiny_dropout, iters=1)
    stepped, rerun, finding, how = run_workers(1, step_then_rerun, argv, timeout=300)[0]
    assert len(stepped) == 2 and rerun == stepped
    assert finding is None and how == "updated"  # a finite step: its update was not held
