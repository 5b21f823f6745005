"""The generation tests import the process harness from tests/distributed and the pretraining
workers from tests/training (a tiny checkpoint to decode with)."""

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "distributed"))
sys.path.insert(0, str(HERE.parent / "training"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def pipeline_trained(train_data, tmp_path_factory):
    """The checkpoint of a 2-step pretraining run on a 2-stage pipeline (the training tests'
    tiny model and data), shared by the tests that decode it; beside it, `whole_model.pt`:
    the trained model's state dict as the ranks held it at the end (pipeline_trained_model)."""
    import torch
    from generation_workers import run_pretrain_keeping_whole_model
    from harness import run_workers
    from train_workers import base_argv

    ckpt = tmp_path_factory.mktemp("pipeline_trained") / "ckpt_pp2"
    stages = run_workers(2, run_pretrain_keeping_whole_model,
                         base_argv(train_data, "--save", str(ckpt),
                                   "--pipeline-model-parallel-size", "2", iters=2),
                         timeout=600)
    whole = {}
    for held in stages:  # (a tied module held by both stages: the same tensor)
        for name, tensor in held.items():
            whole.setdefault(name, tensor)
    torch.save(whole, ckpt.parent / "whole_model.pt")
    return ckpt


@pytest.fixture(scope="session")
def pipeline_trained_model(pipeline_trained):
    """The state dict of pipeline_trained's model as the training ranks held it (its stages
    joined from the tensors each stage held, not read back from the checkpoint)."""
    import torch

    return torch.load(pipeline_trained.parent / "whole_model.pt", weights_only=True)
