"""Issue 47 item 2 in one process: MegatronT5LM over our checkpoint (megatron.evaluate.load_lm),
run by the harness's own evaluator on the four local tasks, answers every request as the
reference run of `lm_eval --model hf ...,backend=seq2seq` on the export does: loglikelihoods
within 1e-4 (rolling: 1e-6 relative) with the same is_greedy, greedy generations identical, at
the reference's batch size, zero-shot and few-shot. (The layouts, TP 2 and PP 2, are the
main tests' business; reference.response_mismatches compares any run with the reference.)"""

import pytest

from reference import (FEWSHOT, LOCAL_TASKS, REFERENCE_BATCH, TASKS_DIR,
                       response_mismatches, responses_of)

pytestmark = pytest.mark.slow  # (the reference runs)


@pytest.mark.parametrize("run_name", ["reference_run", "reference_run_fewshot"])
def test_megatron_evaluate_answers_as_the_hf_backend(run_name, request, eval_model):
    import lm_eval
    from lm_eval.tasks import TaskManager

    from megatron.evaluate import load_lm

    reference = request.getfixturevalue(run_name)
    settings = FEWSHOT if run_name == "reference_run_fewshot" else {}
    options = {"max_length": 48} if settings else {}
    lm = load_lm(str(eval_model.checkpoint), tokenizer_model=str(eval_model.spm_model),
                 batch_size=REFERENCE_BATCH, **options)
    out = lm_eval.simple_evaluate(model=lm, tasks=list(LOCAL_TASKS),
                                  task_manager=TaskManager(include_path=str(TASKS_DIR)),
                                  num_fewshot=settings.get("num_fewshot"),
                                  limit=settings.get("limit"), log_samples=True)
    ours = responses_of(out["samples"], out["configs"])
    assert len(ours) == len(reference.requests) > 20
    assert response_mismatches(reference, ours) == []
