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
