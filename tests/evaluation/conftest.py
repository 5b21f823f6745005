"""The evaluation tests: a tiny trained T5 model as our checkpoint and its `--to hf` export
(eval_model.py), and the reference runs of the real `lm_eval` command with the harness's own
hf seq2seq backend on that export over the local tasks of tests/data/eval_tasks (reference.py),
shared by the tests that compare against them. The process harness of tests/distributed, the
tiny models of tests/generation and the training workers of tests/training are importable here.
"""

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "distributed"))
sys.path.insert(0, str(HERE.parent / "generation"))
sys.path.insert(0, str(HERE.parent / "training"))
sys.path.insert(0, str(HERE))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """The in-process model calls here are tiny: one thread (several spin against each other
    on a small shared machine, several times slower); the setting is restored after."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def eval_model(spm_model, tmp_path_factory):
    """EvalModel(checkpoint, export, spm_model) of eval_model.write_eval_model (about 5 s)."""
    from eval_model import write_eval_model

    return write_eval_model(tmp_path_factory.mktemp("eval_model"), spm_model)


@pytest.fixture(scope="session")
def reference_run(eval_model, tmp_path_factory):
    """The `lm_eval` command (hf, backend=seq2seq, fp32, CPU) over the four local tasks,
    zero-shot, batch reference.REFERENCE_BATCH (about 15 s)."""
    from reference import LOCAL_TASKS, REFERENCE_BATCH, run_lm_eval

    return run_lm_eval(eval_model.export, LOCAL_TASKS, tmp_path_factory.mktemp("lm_eval_hf"),
                       batch_size=REFERENCE_BATCH)


@pytest.fixture(scope="session")
def reference_run_fewshot(eval_model, tmp_path_factory):
    """The same command with reference.FEWSHOT's settings (about 15 s)."""
    from reference import FEWSHOT, LOCAL_TASKS, REFERENCE_BATCH, run_lm_eval

    return run_lm_eval(eval_model.export, LOCAL_TASKS,
                       tmp_path_factory.mktemp("lm_eval_hf_fewshot"),
                       batch_size=REFERENCE_BATCH, **FEWSHOT)
