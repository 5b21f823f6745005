"""The reference for megatron.evaluate (issue 47 item 2): the real `lm_eval` command with the
harness's own hf seq2seq backend on our `--to hf` export runs the four local tasks, and each of
its responses is what the exported transformers model gives under the rules of
harness_rules.py, recomputed here request by request: every loglikelihood (multiple choice,
Chinese classification, rolling perplexity) within 1e-4 and its is_greedy, every greedy
generation identical, zero-shot and few-shot (with a max_length that truncates contexts and cuts
documents into windows). An adapter that matches these runs follows the harness."""

from collections import Counter

import pytest
import torch

import harness_rules as rules
from reference import DEFAULT_MAX_LENGTH, LOCAL_TASKS, REFERENCE_BATCH, RUNS

pytestmark = pytest.mark.slow  # (two lm_eval runs of about 15 s each, shared by the module)

LOGLIKELIHOOD = ("loglikelihood", "multiple_choice")


@pytest.fixture(scope="module")
def hf(eval_model):
    """(T5ForConditionalGeneration, tokenizer) as the backend loads them: from_pretrained in
    fp32, AutoTokenizer (fast)."""
    from transformers import AutoTokenizer, T5ForConditionalGeneration

    model = T5ForConditionalGeneration.from_pretrained(eval_model.export,
                                                       dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(eval_model.export)


def test_backend_max_length_is_the_default(hf):
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.utils import resolve_max_length

    model, tok = hf
    assert resolve_max_length(model.config, tok, default=HFLM._DEFAULT_MAX_LENGTH) \
        == DEFAULT_MAX_LENGTH


def test_reference_run_has_every_request_of_the_four_tasks(reference_run, hf):
    """All docs of the four tasks answered, with the harness's metrics, and outputs that can
    tell an adapter's mistakes apart: choices both right and wrong, greedy continuations and
    not, generations that differ, stop early and run to the length limit."""
    results = reference_run.results["results"]
    assert set(results) == set(LOCAL_TASKS)
    assert {"acc,none", "acc_norm,none"} <= set(results["local_mc_en"])
    assert "acc,none" in results["local_lcqmc_zh"]
    assert "exact_match,none" in results["local_gen_en"]
    assert {"word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"} \
        <= set(results["local_rolling"])
    docs = Counter(task for task, _, index in reference_run.requests if index == 0)
    assert docs == {"local_mc_en": 12, "local_gen_en": 15, "local_rolling": 10,
                    "local_lcqmc_zh": 16}
    requests = reference_run.requests.values()
    greedy = {r.response[1] for r in requests if r.output_type in LOGLIKELIHOOD}
    assert greedy == {True, False}
    generations = [r.response for r in requests if r.output_type == "generate_until"]
    assert len(set(generations)) >= 10
    _, tok = hf
    lengths = [len(tok(g, add_special_tokens=False).input_ids) for g in generations]
    assert min(lengths) < 8 < max(lengths)  # max_gen_toks is 8


@pytest.mark.parametrize("run_name", RUNS)
def test_loglikelihoods_are_the_exported_models(run_name, request, hf):
    """Each loglikelihood and is_greedy of the run equals the export's own, the request
    tokenized and truncated by the harness's rules (context + EOS; trailing space moved to
    the continuation; an empty context as EOS); each rolling loglikelihood, the sum over its
    windows. 1e-4 absolute for the short requests (the harness's fp32 sums); rolling sums of a
    few thousand nats to 1e-6 relative (fp32 cannot hold 1e-4 there)."""
    run, max_length = request.getfixturevalue(run_name), RUNS[run_name]
    model, tok = hf
    checked = Counter()
    for key, req in run.requests.items():
        if req.output_type in LOGLIKELIHOOD:
            context, continuation = rules.truncate_pair(
                *rules.loglikelihood_pair(tok, *req.arguments), max_length)
            want, is_greedy = rules.score(model, context, continuation)
            assert req.response[0] == pytest.approx(want, abs=1e-4), (key, req.arguments)
            assert req.response[1] == is_greedy, (key, req.arguments)
        elif req.output_type == "loglikelihood_rolling":
            windows = rules.rolling_windows(tok, req.arguments[0], max_length)
            want = sum(rules.score(model, enc, labels)[0] for enc, labels in windows)
            assert req.response == pytest.approx(want, rel=1e-6), key
            checked["windows"] += len(windows)
        checked[req.output_type] += 1
    assert checked["multiple_choice"] == (36 + 32 if run_name == "reference_run" else 13 + 8)
    assert checked["loglikelihood_rolling"] == (10 if run_name == "reference_run" else 4)
    if run_name == "reference_run_fewshot":
        assert checked["windows"] > checked["loglikelihood_rolling"]  # documents were cut


@pytest.mark.parametrize("run_name", RUNS)
def test_generations_follow_the_batch_length_rule(run_name, request, hf):
    """Each greedy generation of the run is the export's own greedy decoding of its context
    alone, run to EOS or to the limit of its batch (the batch's longest context + max_gen_toks
    - 1 tokens: generate's max_length bounds the decoder), decoded without special tokens and
    cut at the first stop string. Some generations of the zero-shot run reach that limit and are
    longer than max_gen_toks tokens, so an adapter that stops at max_gen_toks fails here."""
    run, max_length = request.getfixturevalue(run_name), RUNS[run_name]
    model, tok = hf
    requests = {key: r for key, r in run.requests.items() if r.output_type == "generate_until"}
    keys = sorted(requests)
    kwargs = requests[keys[0]].arguments[1]
    assert all(requests[k].arguments[1] == kwargs for k in keys)  # one batching group
    contexts = [requests[k].arguments[0] for k in keys]
    longer = 0
    for batch in rules.generation_batches(tok, contexts, REFERENCE_BATCH):
        limit = rules.generation_limit(tok, [contexts[i] for i in batch],
                                       kwargs["max_gen_toks"], max_length)
        for i in batch:
            ids = rules.greedy_ids(model, tok, contexts[i], limit, max_length)
            assert requests[keys[i]].response == rules.finish_generation(tok, ids,
                                                                         kwargs["until"]), \
                (keys[i], ids)
            longer += len(ids) - 1 > kwargs["max_gen_toks"] and ids[-1] != tok.eos_token_id
    if run_name == "reference_run":  # (the few-shot run's first 4 docs all stop early)
        assert longer > 0


def test_hf_backend_ties_an_untied_head(spm_model, tmp_path):
    """Why the reference model is tied: lm_eval's HFLM calls `model.tie_weights()` after
    loading (models/huggingface.py:392), and transformers 5.x's T5Config always says tied, so
    an untied export (T5 v1.1, CPM-2) is scored with its embedding as the head, not the head
    that from_pretrained loaded. When this fails, the harness scores untied models as they
    are, and the reference may use one."""
    from lm_eval.models.huggingface import HFLM
    from transformers import T5ForConditionalGeneration

    from eval_model import EVAL_MODEL, write_eval_model

    untied = write_eval_model(tmp_path, spm_model, dict(EVAL_MODEL, tie_word_embeddings=False),
                              steps=0)
    loaded = T5ForConditionalGeneration.from_pretrained(untied.export)
    assert not torch.equal(loaded.lm_head.weight, loaded.shared.weight)
    backend = HFLM(pretrained=str(untied.export), backend="seq2seq", device="cpu",
                   dtype="float32", batch_size=1)
    assert torch.equal(backend.model.lm_head.weight, backend.model.shared.weight)


def test_empty_context_and_moved_space_reach_the_continuation(reference_run, hf):
    """The two rewrites of the loglikelihood path, seen in the run's own requests: a context
    ending in a space scores the continuation with the space in front (here the same ids: the
    tokenizer folds runs of spaces), an empty context scores it after EOS alone."""
    _, tok = hf
    args = {key: r.arguments for key, r in reference_run.requests.items()}
    context, continuation = args["local_mc_en", 2, 0]  # "The cat sat on the " + " mat"
    assert context.endswith(" ") and continuation == " mat"
    enc, dec = rules.loglikelihood_pair(tok, context, continuation)
    assert enc == tok("The cat sat on the").input_ids
    assert dec == tok("  mat", add_special_tokens=False).input_ids \
        == tok(" mat", add_special_tokens=False).input_ids
    context, continuation = args["local_mc_en", 6, 0]
    assert context == ""
    assert rules.loglikelihood_pair(tok, context, continuation) \
        == ([tok.eos_token_id], tok(continuation, add_special_tokens=False).input_ids)
