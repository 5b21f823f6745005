"""The harness's requests on Mixture-of-Experts models at expert-parallel size 2 (gloo), each
router (switch, top-k, BASE, CPM-2-MoE's), answered as one process answers them: the data-
parallel ranks split the requests unevenly and run their model calls in lockstep (a rank with
no batch left runs dummy ones), at batch sizes that leave one rank a batch fewer."""

import pytest
from evaluation_workers import answers, moe_answers_at_ep_2, moe_model
from harness import run_workers

from megatron.data.tokenizers.tokenizer import build_tokenizer, resolve_tokenizer
from megatron.evaluation.harness_lm import MegatronT5LM
from megatron.model.state_dict import gather_full_state_dict


@pytest.mark.parametrize("router,batch_size", [("switch", 2), ("topk", 3), ("base", 2),
                                               ("cpm2", 4)])
def test_every_router_at_expert_parallel_2_answers_as_one_process(router, batch_size,
                                                                  spm_model):
    tokenizer = build_tokenizer(resolve_tokenizer(str(spm_model), None))
    model = moe_model(router, tokenizer.vocab_size)
    one = answers(MegatronT5LM(model, tokenizer, batch_size=batch_size, max_length=64))
    got = run_workers(2, moe_answers_at_ep_2, router, gather_full_state_dict(model),
                      str(spm_model), batch_size, timeout=300)
    for kind, expected in one.items():
        merged = [None] * len(expected)
        merged[0::2], merged[1::2] = got[0][kind], got[1][kind]
        if kind == "generate_until":
            assert merged == expected
            continue
        values = [a[0] if isinstance(a, tuple) else a for a in merged]
        reference = [a[0] if isinstance(a, tuple) else a for a in expected]
        assert values == pytest.approx(reference, rel=1e-5, abs=1e-4), kind
        if kind == "loglikelihood":
            assert [a[1] for a in merged] == [a[1] for a in expected]
    assert any(text for text in one["generate_until"])  # something generated


def test_the_command_at_expert_parallel_2(spm_model, tmp_path):
    """`python -m megatron.evaluate --expert-model-parallel-size 2` on 2 processes (each holds
    2 of the 4 experts of a CPM-2-MoE-routed checkpoint, DP 2) writes the one-process run's
    answers and metrics (the loglikelihood tasks: generations that run to their limit depend
    on their batch)."""
    from evaluation_workers import run_evaluate
    from reference import TASKS_DIR, read_run

    from megatron.checkpoint.formats.weights import write_weights_checkpoint
    from megatron.evaluate import main

    tokenizer = build_tokenizer(resolve_tokenizer(str(spm_model), None))
    model = moe_model("cpm2", tokenizer.vocab_size)
    write_weights_checkpoint(tmp_path / "ckpt", gather_full_state_dict(model).items(),
                             {"config": model.config.to_dict(),
                              "make_vocab_size_divisible_by": 128})
    argv = ["--load", str(tmp_path / "ckpt"), "--tokenizer-model", str(spm_model),
            "--tasks", "local_mc_en,local_lcqmc_zh", "--include-path", str(TASKS_DIR),
            "--batch-size", "3", "--log-samples", "--bootstrap-iters", "0", "--output-path"]
    assert main(argv + [str(tmp_path / "one")]) == 0
    assert run_workers(2, run_evaluate, argv + [str(tmp_path / "two"),
                                                "--expert-model-parallel-size", "2"],
                       timeout=300) == [(0, [2], True)] * 2  # 2 of 4 experts each
    one, two = read_run(tmp_path / "one"), read_run(tmp_path / "two")
    assert one.requests.keys() == two.requests.keys() and len(one.requests) > 20
    for key, request in one.requests.items():
        got = two.requests[key].response
        assert got[0] == pytest.approx(request.response[0], rel=1e-5, abs=1e-4), key
        assert got[1] == request.response[1], key
    for task in ("local_mc_en", "local_lcqmc_zh"):
        assert two.results["results"][task]["acc,none"] == \
            one.results["results"][task]["acc,none"]
