"""Pipeline parallelism (DeepSpeed's PipelineEngine) gives the single-process run: losses,
gradient norms and evaluation losses of several steps, under PP=2, PP=2 x DP=2, TP=2 x PP=2 and
PP=4 (encoder and decoder each split in two), tied and untied embeddings, ZeRO-0 and ZeRO-1,
fp32 and bf16; exact resume with dropout."""

import json

import pytest

from harness import run_workers
from train_workers import assert_same_run, base_argv, run_pretrain, \
    run_pretrain_counting_samples

pytestmark = pytest.mark.slow


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
    # bf16: the stages sum the gradients in another order than one process; a master weight
    # 1e-7 away then rounds to the other bf16 neighbour, one bf16 ulp off (2^-8 to 2^-7
    # relative), from step 3 on. Measured (AMD EPYC without avx512_bf16): 2.5e-4 (losses),
    # 9.1e-5 (evaluations), 9.0e-4 (gradient norms); the bound is 2^-8, one ulp at its smallest.
    assert_same_run(got[0][3], single[2], rtol=2.0 ** -8, label="PP=2 bf16 ZeRO-1")
    # step 1 runs at lr 0: steps 1 and 2 see the weights as built, the same bf16 bits
    assert [got[0][3]["losses"][i] for i in (1, 2)] == [single[2]["losses"][i] for i in (1, 2)]


def test_pipeline_with_data_and_tensor_parallelism_matches_one_process(train_data, tied, single):
    """PP=2 x DP=2 (ZeRO 0 and 1), TP=2 x PP=2, and PP=4 with the encoder and the decoder each
    on two stages (split rank 2), tied and untied, recomputed activations. Only the first and
    the last stage read data: the two middle stages of PP=4 load no sample."""
    pp2 = ["--pipeline-model-parallel-size", "2"]
    runs = [base_argv(train_data, *pp2),
            base_argv(train_data, *pp2, "--zero-stage", "1", model=tied),
            base_argv(train_data, *pp2, "--tensor-model-parallel-size", "2", "--zero-stage",
                      "1"),
            base_argv(train_data, *pp2, "--tensor-model-parallel-size", "2", model=tied),
            base_argv(train_data, "--pipeline-model-parallel-size", "4",
                      "--pipeline-model-parallel-split-rank", "2"),
            base_argv(train_data, "--pipeline-model-parallel-size", "4",
                      "--pipeline-model-parallel-split-rank", "2", "--checkpoint-activations",
                      "--zero-stage", "1", model=tied)]
    got = run_workers(4, run_pretrain_counting_samples, runs, timeout=1200)
    read = [[result.pop("samples_read") for result in rank] for rank in got]
    assert all(g == got[0] for g in got)
    for i in (4, 5):  # PP=4: stages 0 and 3 read, 1 and 2 do not
        assert [read[rank][i] > 0 for rank in range(4)] == [True, False, False, True], read
    for i, want in enumerate((0, 1, 0, 1, 0, 1)):
        assert_same_run(got[0][i], single[want], rtol=2e-5, label=runs[i])


def test_resume_is_exact_with_a_pipeline(train_data, tmp_path):
    """PP=2 x DP=2, ZeRO-1, dropout on: 3 steps, save, stop, load, 3 more give the straight
    run's losses bit for bit; a weights-only load (--finetune) also works; loading with another
    pipeline size is refused before anything is built, naming the sizes."""
    ckpt = str(tmp_path / "ckpt")
    run = lambda *extra: base_argv(train_data, "--pipeline-model-parallel-size", "2",  # noqa
                                   "--zero-stage", "1", *extra, model=train_data.tiny_dropout,
                                   iters=6)
    straight, first, second, finetune = run_workers(4, run_pretrain, [
        run(), run("--save", ckpt, "--exit-interval", "3"), run("--save", ckpt, "--load", ckpt),
        run("--load", ckpt, "--finetune"),
    ], timeout=900)[0]
    assert first["iteration"] == 3 and second["iteration"] == 6
    for i in range(1, 7):  # exact float equality: the same bits
        assert (first["losses"] | second["losses"])[i] == straight["losses"][i], i
    assert first["evals"] + second["evals"] == straight["evals"]
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "6\n"
    meta = json.loads((tmp_path / "ckpt" / "iter_0000006" / "meta.json").read_text())
    assert meta["layout"]["pipeline_model_parallel_size"] == 2
    assert sorted(finetune["losses"]) == list(range(1, 7))
    assert finetune["losses"][1] < straight["losses"][1]  # it started from trained weights


def test_optimizer_offload_with_a_pipeline(train_data, single):
    """ZeRO-1 with the optimizer offloaded to the CPU (DeepSpeedCPUAdam) under PP=2 gives the
    one-process fp32 run (as under data parallelism, 1e-4: another Adam)."""
    got = run_workers(2, run_pretrain, [
        base_argv(train_data, "--pipeline-model-parallel-size", "2", "--zero-stage", "1",
                  "--offload-optimizer", "cpu")], timeout=900)
    assert got[0] == got[1]
    assert_same_run(got[0][0], single[0], rtol=1e-4)
