"""Our SentencePiece tokenizer (megatron/data/tokenizers/tokenizer.py, as `--tokenizer-model`
builds it) against the export's tokenizer as lm_eval's hf backend loads it (AutoTokenizer, fast:
tokenizer.json), on every string the backend tokenizes in the reference runs, as it tokenizes
it: contexts with EOS (none after a leading "</s>"), continuations after the trailing-space
move and without special tokens, an empty context's continuation, rolling documents with EOS,
generation contexts and stop strings; and every decoding it does: the greedy generations of the
runs (start token first, skip_special_tokens=True) and the decoded EOS. An adapter that
tokenizes with ours therefore gives the backend's ids."""

import pytest

import harness_rules as rules
from reference import REFERENCE_BATCH, RUNS

pytestmark = pytest.mark.slow  # (the reference runs)


@pytest.fixture(scope="module")
def tokenizers(eval_model):
    """(ours, the export's) as `--tokenizer-model` and lm_eval build them."""
    from transformers import AutoTokenizer

    from megatron.data.tokenizers.tokenizer import build_tokenizer, resolve_tokenizer

    ours = build_tokenizer(resolve_tokenizer(str(eval_model.spm_model)))
    return ours, AutoTokenizer.from_pretrained(eval_model.export)


def harness_encodings(run, hf):
    """(text, add_eos) of each encoding the backend does for the run's requests."""
    eos_text = hf.decode(rules.prefix_token_id(hf))
    out = []
    for req in run.requests.values():
        if req.output_type in ("loglikelihood", "multiple_choice"):
            context, continuation = req.arguments
            if context:
                n_spaces = len(context) - len(context.rstrip())
                if n_spaces:
                    context, continuation = context[:-n_spaces], context[-n_spaces:] + \
                        continuation
                out.append((context, not context.startswith(eos_text)))
            out.append((continuation, False))
        elif req.output_type == "loglikelihood_rolling":
            out.append((req.arguments[0], True))
        else:
            context, kwargs = req.arguments
            out.append((context, not context.startswith(eos_text)))
            out += [(stop, False) for stop in kwargs["until"]]
    return out


@pytest.mark.parametrize("run_name", RUNS)
def test_encodings_equal_the_backends(run_name, request, tokenizers):
    run = request.getfixturevalue(run_name)
    ours, hf = tokenizers
    encodings = harness_encodings(run, hf)
    differ = [(text, add_eos) for text, add_eos in encodings
              if ours.encode(text, add_eos=add_eos)
              != hf(text, add_special_tokens=add_eos).input_ids]
    assert not differ
    assert len(encodings) > 50
    if run_name == "reference_run":  # (the few-shot run has the first 4 docs of each task)
        texts = "".join(text for text, _ in encodings)
        for seen in ("<extra_id_0>", "🙂", "鼾", "\n\n", "  "):  # sentinel, bytes, runs
            assert seen in texts


@pytest.mark.parametrize("run_name", RUNS)
def test_generation_decoding_equals_the_backends(run_name, request, tokenizers, hf_model):
    """The ids of each greedy generation of the run (the reference's rule), decoded by both
    with skip_special_tokens=True as the backend decodes them, and the decoded EOS that the
    backend adds to the stop strings."""
    run, max_length = request.getfixturevalue(run_name), RUNS[run_name]
    ours, hf = tokenizers
    requests = [r for _, r in sorted(run.requests.items()) if r.output_type == "generate_until"]
    contexts = [r.arguments[0] for r in requests]
    max_gen_toks = requests[0].arguments[1]["max_gen_toks"]
    for batch in rules.generation_batches(hf, contexts, REFERENCE_BATCH):
        limit = rules.generation_limit(hf, [contexts[i] for i in batch], max_gen_toks,
                                       max_length)
        for i in batch:
            ids = rules.greedy_ids(hf_model, hf, contexts[i], limit, max_length)
            assert ours.decode(ids, skip_special_tokens=True) \
                == hf.decode(ids, skip_special_tokens=True), ids
    assert ours.decode([ours.eos_id]) == hf.decode(hf.eos_token_id) == "</s>"


@pytest.fixture(scope="module")
def hf_model(eval_model):
    import torch
    from transformers import T5ForConditionalGeneration

    return T5ForConditionalGeneration.from_pretrained(eval_model.export,
                                                      dtype=torch.float32).eval()
