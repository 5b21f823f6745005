"""Generation on several processes (gloo) and from a real training checkpoint: greedy, sampling
and beam search at TP 2 equal transformers' `generate`; `python -m megatron.generate` on the
checkpoint of a 2-step pretraining run writes text and ids, the same at TP 1 and TP 2 (the
checkpoint, saved at TP 1, split on load)."""

import json

import pytest
import torch
from generation_models import hf_of, hf_rows, our_model, padded_batch, same_outputs
from harness import run_workers
from train_workers import base_argv, run_pretrain

from megatron.model.state_dict import gather_full_state_dict

pytestmark = pytest.mark.slow

BEAMS = dict(num_beams=3, length_penalty=0.8, early_stopping=False, no_repeat_ngram_size=2)
SAMPLING = dict(temperature=0.8, top_k=20, top_p=0.9, seed=5)


@pytest.mark.parametrize("name", ["v1_0", "v1_1"])
def test_tensor_parallel_search_equals_transformers(name):
    model = our_model(name, seed=3)
    full = gather_full_state_dict(model)
    hf = hf_of(model, name)
    ids, mask = padded_batch(seed=3)
    from generation_workers import decode_tensor_parallel

    got = run_workers(2, decode_tensor_parallel, name, full,
                      ids, mask, BEAMS, SAMPLING, timeout=300)
    with torch.no_grad():
        greedy = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12,
                             do_sample=False, num_beams=1, use_cache=False)
        torch.manual_seed(SAMPLING["seed"])  # transformers samples from the global generator
        sampled = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12,
                              do_sample=True, use_cache=False, temperature=0.8, top_k=20,
                              top_p=0.9)
        beams = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10,
                            do_sample=False, output_scores=True, return_dict_in_generate=True,
                            use_cache=False, **BEAMS)
    for rank in got:
        assert rank["greedy"] == hf_rows(greedy)
        assert rank["sample"] == hf_rows(sampled)
        assert rank["beam"] == hf_rows(beams.sequences)
        torch.testing.assert_close(rank["scores"], beams.sequences_scores, rtol=1e-5,
                                   atol=1e-5)


@pytest.fixture(scope="module")
def trained(train_data, tmp_path_factory):
    """The checkpoint of a 2-step one-process pretraining run (the training tests' tiny
    model and data)."""
    ckpt = tmp_path_factory.mktemp("trained") / "ckpt"
    run_workers(1, run_pretrain, [base_argv(train_data, "--save", str(ckpt), iters=2)],
                timeout=600)
    return ckpt


def test_generate_from_a_pretraining_checkpoint_at_tp_1_and_2(train_data, trained, tmp_path):
    from generation_workers import run_generate

    texts = ["To be, or not to be", "Good morrow, kind sir.", "从前有座山", "The king"]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts),
                   encoding="utf-8")
    outputs = {}
    for tp, extra in ((1, []), (2, ["--tensor-model-parallel-size", "2"])):
        for mode in (["--num-beams", "1"], ["--num-beams", "3"]):
            out = tmp_path / f"out_tp{tp}_{mode[1]}.jsonl"
            argv = ["--load", str(trained), "--tokenizer-model", train_data.spm,
                    "--input", str(inp), "--output", str(out), "--max-new-tokens", "6",
                    "--micro-batch-size", "3", *mode, *extra]
            result = run_workers(tp, run_generate, argv, timeout=300)[0]
            assert result["code"] == 0
            outputs[tp, mode[1]] = [json.loads(line) for line in result["text"].splitlines()]
    for beams in ("1", "3"):
        one, two = outputs[1, beams], outputs[2, beams]
        assert len(one) == len(texts)
        assert all(isinstance(r["text"], str) and r["ids"] for r in one)
        assert [r["ids"] for r in one] == [r["ids"] for r in two]
        assert [r["text"] for r in one] == [r["text"] for r in two]
        same_outputs("\n".join(map(json.dumps, one)), "\n".join(map(json.dumps, two)))
    assert all("score" in r for r in outputs[1, "3"])


def test_torchrun_launches_it_like_training(train_data, trained, tmp_path):
    """`torchrun --nproc-per-node 2 -m megatron.generate ... --tensor-model-parallel-size 2`
    writes what one process without torchrun writes."""
    import subprocess
    import sys
    from pathlib import Path

    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["The king", "Good morrow"]))
    flags = ["--load", str(trained), "--tokenizer-model", train_data.spm, "--input", str(inp),
             "--max-new-tokens", "5", "--num-beams", "2"]
    repo = Path(__file__).resolve().parents[2]
    one = subprocess.run([sys.executable, "-m", "megatron.generate", *flags, "--output",
                          str(tmp_path / "one.jsonl")], cwd=repo, capture_output=True,
                         text=True, timeout=300)
    assert one.returncode == 0, one.stderr
    # --standalone: the rendezvous on a port the launcher takes itself (localhost:0), none
    # chosen here that another process could take first
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--standalone", "-m", "megatron.generate", *flags,
                          "--tensor-model-parallel-size", "2", "--output",
                          str(tmp_path / "two.jsonl")], cwd=repo, capture_output=True,
                         text=True, timeout=300)
    assert two.returncode == 0, two.stderr
    same_outputs((tmp_path / "one.jsonl").read_text(), (tmp_path / "two.jsonl").read_text())


def test_a_checkpoint_saved_at_tp_2_decodes_at_tp_1(train_data, tmp_path):
    """Saved by a TP 2 run, read as full tensors: one process decodes what two do, and what
    one process decodes in-process with the weights the training ranks held (joined here from
    their shards, not read back from the checkpoint)."""
    from generation_workers import run_generate, run_pretrain_keeping_shards

    from megatron.tensor_parallel.layers import unshard

    ckpt = tmp_path / "ckpt_tp2"
    shards = run_workers(2, run_pretrain_keeping_shards,
                         base_argv(train_data, "--save", str(ckpt),
                                   "--tensor-model-parallel-size", "2", iters=2), timeout=600)
    texts = ["The king", "Good morrow"]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    outputs = []
    for tp in (1, 2):
        argv = ["--load", str(ckpt), "--tokenizer-model", train_data.spm, "--input", str(inp),
                "--output", str(tmp_path / f"out{tp}.jsonl"), "--max-new-tokens", "6",
                "--num-beams", "2", "--tensor-model-parallel-size", str(tp)]
        result = run_workers(tp, run_generate, argv, timeout=300)[0]
        assert result["code"] == 0
        outputs.append(result["text"])
    same_outputs(*outputs)
    assert len(outputs[0].splitlines()) == 2

    full = {name: part if dim is None else unshard([part, shards[1][name][0]], dim, stride)
            for name, (part, dim, stride) in shards[0].items()}
    same_outputs(outputs[0], one_process_outputs(ckpt, full, train_data.spm, texts, beams=2))


def one_process_outputs(ckpt, state, spm, texts, beams):
    """OUT.jsonl's text as one process decodes `texts` (one micro-batch, 6 new tokens) in
    process with the model of `ckpt`'s meta.json holding `state` (a state dict as training
    held it, its vocabulary rows padded for the training layout), not the checkpoint's
    tensors."""
    from megatron.checkpoint.formats.deepspeed import find_iteration, model_config, read_meta
    from megatron.data.tokenizers.tokenizer import build_tokenizer, resolve_tokenizer
    from megatron.generation import Decoder, DecodingSettings, SpecialTokens, search
    from megatron.model import T5Model
    from megatron.model.state_dict import VOCAB_PARAMETERS, load_full_state_dict

    meta = read_meta(find_iteration(ckpt))
    config = model_config(meta)
    model = T5Model(config, make_vocab_size_divisible_by=meta["model"][
        "make_vocab_size_divisible_by"])
    load_full_state_dict(model, {name: t[:config.vocab_size] if name in VOCAB_PARAMETERS else t
                                 for name, t in state.items()})
    model.eval()
    tok = build_tokenizer(resolve_tokenizer(spm))
    encoded = [tok.encode(t, add_eos=True) for t in texts]
    n = max(map(len, encoded))
    ids = torch.tensor([e + [tok.pad_id] * (n - len(e)) for e in encoded])
    mask = torch.tensor([[1] * len(e) + [0] * (n - len(e)) for e in encoded])
    start, eos, pad = tok.decoder_start_token_id, tok.eos_id, tok.pad_id
    found = search(Decoder(model, ids, mask, expand=beams), len(texts),
                   SpecialTokens(start, eos, pad), DecodingSettings(max_new_tokens=6,
                                                                    num_beams=beams))
    return "\n".join(json.dumps({"ids": h.ids, "text": tok.decode([i for i in h.ids
                                                                   if i not in (eos, pad)]),
                                 **({"score": h.score} if beams > 1 else {})})
                     for h in found)


def test_a_pipeline_checkpoint_decodes_as_its_merged_copy(train_data, pipeline_trained,
                                                          pipeline_trained_model, tmp_path):
    """Saved by a 2-stage pipeline run, read as full tensors (the stages' layer files joined):
    the ids and text of the copy that convert_checkpoint.py merges to one stage, and of one
    process's search in-process on the weights the training ranks held."""
    from generation_workers import run_generate

    from data_tools import convert_checkpoint

    ckpt, merged = pipeline_trained, tmp_path / "merged"
    assert convert_checkpoint.main(["--load", str(ckpt), "--to", "megatron", str(merged),
                                    "--target-pipeline-parallel-size", "1", "--weights-only",
                                    "--no-progress"]) == 0
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["The king", "Good morrow"]))
    texts = []
    for name, load in (("pp2", ckpt), ("merged", merged)):
        argv = ["--load", str(load), "--tokenizer-model", train_data.spm, "--input", str(inp),
                "--output", str(tmp_path / f"{name}.jsonl"), "--max-new-tokens", "6"]
        result = run_workers(1, run_generate, argv, timeout=300)[0]
        assert result["code"] == 0
        texts.append(result["text"])
    assert texts[0] == texts[1] and len(texts[0].splitlines()) == 2
    same_outputs(texts[0], one_process_outputs(ckpt, pipeline_trained_model, train_data.spm,
                                               ["The king", "Good morrow"], beams=1))
