"""The loss of a run does not depend on how it is parallelised: DP=2 under every ZeRO stage (with
and without optimizer offload), fp32 and bf16, and TP=2 x DP=2, against one process that reaches
the same global batch by gradient accumulation."""

import json
import threading

import pytest

from harness import run_workers
from train_workers import assert_same_run, base_argv, losses, run_pretrain

pytestmark = pytest.mark.slow

# bf16 under data parallelism against one bf16 process, by ZeRO stage (measured: AMD EPYC without
# avx512_bf16, torch 2.13 CPU). Both sides run the same kernels on the same micro-batches, so
# only the order of the gradient sums differs. ZeRO-1 and -2 add the two micro-batches' gradients
# as one process does (a + b = b + a): losses and evaluations equal, norms within 1.1e-7, so the
# fp32 bound. ZeRO-3 reduces them in other sums: a master weight 1e-7 away then rounds to the
# other bf16 neighbour, one bf16 ulp off (2^-8 to 2^-7 relative), from step 3 on; measured 6.6e-5
# (losses), 3.7e-4 (evaluations), 1.6e-3 (gradient norms). The bound is 2^-8, one bf16 ulp at
# its smallest.
BF16_RTOL = {"1": 2e-5, "2": 2e-5, "3": 2.0 ** -8}


@pytest.fixture(scope="module")
def single(train_data):
    """One process, accumulation 2: fp32 (ZeRO 0) and bf16 (ZeRO 1)."""
    return run_workers(1, run_pretrain, [base_argv(train_data),
                                         base_argv(train_data, "--bf16", "--zero-stage", "1")],
                       timeout=600)[0]


def test_single_process_run_learns(single):
    fp32 = losses(single[0])
    assert fp32[-1] < fp32[0]
    # step 1 runs at lr 0 (warmup from 0, as Megatron): step 2 starts from the same weights
    assert [e[1] for e in single[0]["evals"]] == ["valid", "valid", "test"]


def test_data_parallel_zero_stages_match_one_process(train_data, single):
    runs = [["--zero-stage", str(s)] for s in (0, 1, 2, 3)]
    runs += [["--zero-stage", "2", "--offload-optimizer", "cpu"],
             ["--zero-stage", "3", "--offload-optimizer", "cpu", "--offload-param", "cpu"]]
    bf16 = [["--bf16", "--zero-stage", str(s)] for s in (1, 2, 3)]
    got = run_workers(2, run_pretrain, [base_argv(train_data, *r) for r in runs + bf16],
                      timeout=900)
    assert got[0] == got[1]  # every rank reports the same global losses
    for flags, result in zip(runs, got[0][:4]):
        assert_same_run(result, single[0], rtol=2e-5, label=flags)
    for flags, result in zip(runs[4:], got[0][4:6]):  # DeepSpeedCPUAdam vs torch's AdamW
        assert_same_run(result, single[0], rtol=1e-4, label=flags)
    for flags, result in zip(bf16, got[0][6:]):
        assert_same_run(result, single[1], rtol=BF16_RTOL[flags[-1]], label=flags)
        # step 1 runs at lr 0: steps 1 and 2 see the weights as built, the same bf16 bits
        assert [result["losses"][i] for i in (1, 2)] == \
            [single[1]["losses"][i] for i in (1, 2)], flags


def test_tensor_and_data_parallel_match_one_process(train_data, single):
    got = run_workers(4, run_pretrain, [base_argv(train_data, "--tensor-model-parallel-size",
                                                  "2", "--zero-stage", "1")], timeout=600)
    assert all(g == got[0] for g in got)
    assert_same_run(got[0][0], single[0], rtol=2e-5)


def test_nvme_offload_matches_one_process(train_data, tmp_path):
    """ZeRO-Infinity: optimizer states and parameters swapped to files (DeepSpeed's async_io on
    libaio), with DeepSpeedCPUAdam. DeepSpeed swaps only tensors of at least 1 MiB (its aio
    block), so the model is wider than the tiny one: each rank's half of the embedding and of
    the head is 1.03 MiB."""
    config = json.loads(open(train_data.tiny).read())
    wide = tmp_path / "wide.json"
    wide.write_text(json.dumps({**config, "d_model": 128, "d_kv": 32}))
    single = run_workers(1, run_pretrain, [base_argv(train_data, model=str(wide))],
                         timeout=600)[0]
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    # DeepSpeed removes its swap files when the engine goes: look for them while it runs
    swapped, done = set(), threading.Event()

    def watch():
        while not done.wait(0.01):
            swapped.update(p.relative_to(nvme).parts[1] for p in nvme.rglob("*.swp"))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        got = run_workers(2, run_pretrain, [base_argv(
            train_data, "--zero-stage", "3", "--offload-optimizer", "nvme", "--offload-param",
            "nvme", "--nvme-path", str(nvme), model=str(wide))], timeout=1200)
    finally:
        done.set()
        watcher.join()
    assert_same_run(got[0][0], single[0], rtol=1e-4)
    # it really swapped to files: optimizer states and parameters
    assert {"optimizer", "float32params"} <= swapped, swapped
