"""Each decoding flag of `python -m megatron.generate` reaches the search and means what
transformers' `generate` means by it, on the real `--to hf` export of a dense T5 model.

A random tiny T5 v1.1 model is written as our weights checkpoint and exported with
data_tools/convert_checkpoint.py `--to hf` (the writer users run); the command (its `main`, in
this process: one call per flag setting) decodes the inputs, and
T5ForConditionalGeneration.from_pretrained(export).generate with the same settings gives the same
ids (and beam scores), micro-batch by micro-batch (sampling: transformers' global generator
seeded as the command seeds each micro-batch, --seed plus its first input's index). Each flag
also changes the outputs of these inputs against the setting without it, so that a flag the
command dropped would fail. --dtype and --attention-backend have no transformers counterpart
here: bf16 gives the in-process search's ids and scores on a bf16 copy of the model (and other
scores than fp32), and the sdpa backend runs torch's sdpa kernel where eager does not.
Greedy decoding runs 40 steps: past the KV cache's first capacity (32 positions)."""

import json

import pytest
import torch

from megatron import generate
from megatron.checkpoint.formats.weights import write_weights_checkpoint
from megatron.data.tokenizers.tokenizer import T5Tokenizer
from megatron.generation import Decoder, DecodingSettings, SpecialTokens, beam_search
from megatron.model import T5Config, T5Model
from megatron.model.state_dict import gather_full_state_dict, load_full_state_dict

pytestmark = pytest.mark.slow  # (about 30 s: 14 in-process commands, 11 of transformers)

TINY = dict(vocab_size=4100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
            num_heads=4, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
            dropout_rate=0.0)
TEXTS = ["To be, or not to be: that is the question.", "Hello world", "床前明月光",
         "The king is dead", "O Romeo, Romeo"]
MICRO_BATCH = 2
LONG = 40  # greedy steps: more than the decoding cache's first 32 positions

BEAMS = (["--num-beams", "2", "--length-penalty", "2.0"], dict(num_beams=2, length_penalty=2.0))
SAMPLE = (["--do-sample", "--seed", "3"], dict(do_sample=True, seed=3))
CASES = {  # name: (flags, transformers' generate settings, max new tokens)
    "greedy": ([], {}, LONG),
    "ngram": (["--no-repeat-ngram-size", "2"], dict(no_repeat_ngram_size=2), LONG),
    "beams_lp1": (["--num-beams", "2"], dict(num_beams=2), 12),
    "beams": (*BEAMS, 12),
    "early": ([*BEAMS[0], "--early-stopping"], dict(**BEAMS[1], early_stopping=True), 12),
    "never": ([*BEAMS[0], "--early-stopping", "never", "--no-repeat-ngram-size", "3"],
              dict(**BEAMS[1], early_stopping="never", no_repeat_ngram_size=3), 12),
    "sample": (*SAMPLE, 12),
    "seed": (["--do-sample", "--seed", "4"], dict(do_sample=True, seed=4), 12),
    "temperature": ([*SAMPLE[0], "--temperature", "0.7"], dict(**SAMPLE[1], temperature=0.7),
                    12),
    "top_k": ([*SAMPLE[0], "--top-k", "20"], dict(**SAMPLE[1], top_k=20), 12),
    "top_p": ([*SAMPLE[0], "--top-p", "0.8", "--temperature", "1.5"],
              dict(**SAMPLE[1], top_p=0.8, temperature=1.5), 12),
}
DIFFER = [("greedy", "ngram"), ("beams_lp1", "beams"), ("beams", "early"), ("beams", "never"),
          ("greedy", "sample"), ("sample", "seed"), ("sample", "temperature"),
          ("sample", "top_k"), ("sample", "top_p")]
"""Pairs of settings whose outputs differ here: each flag changes what is decoded."""


def padded(tok, texts):
    """(ids, mask) as the command batches `texts`: EOS appended, padded."""
    encoded = [tok.encode(t, add_eos=True) for t in texts]
    n = max(map(len, encoded))
    return (torch.tensor([e + [tok.pad_id] * (n - len(e)) for e in encoded]),
            torch.tensor([[1] * len(e) + [0] * (n - len(e)) for e in encoded]))


@pytest.fixture(scope="module")
def export(spm_model, tmp_path_factory):
    """(our weights checkpoint, its `--to hf` export, input file, the model, tokenizer): the
    embedding and head scaled (peaked outputs), EOS's head row along the decoder's mean output
    so that some outputs end before the limit and some run to it, a few tokens favoured so
    that some outputs repeat themselves."""
    from data_tools import convert_checkpoint

    tok = T5Tokenizer(str(spm_model))
    root = tmp_path_factory.mktemp("flags")
    torch.manual_seed(1)
    model = T5Model(T5Config(**TINY), make_vocab_size_divisible_by=128).eval()
    with torch.no_grad():
        model.shared.weight.mul_(3.0)
        model.lm_head.weight.mul_(3.0)
        ids, mask = padded(tok, TEXTS)
        dec = torch.randint(2, 4000, (len(TEXTS), 6), generator=torch.Generator().manual_seed(9))
        hidden = model.run_layers(model.initial_carry(ids, dec, mask)).hidden
        mean = hidden.reshape(-1, hidden.shape[-1]).mean(0)
        head = model.lm_head.weight
        head[tok.eos_id] = mean / mean.norm() * head[:TINY["vocab_size"]].norm(dim=1).mean() * 1.75
        head[100:108] *= 1.2  # a few favoured tokens: some outputs repeat n-grams
    write_weights_checkpoint(root / "ckpt", gather_full_state_dict(model).items(),
                             {"config": T5Config(**TINY).to_dict(),
                              "make_vocab_size_divisible_by": 128})
    assert convert_checkpoint.main(["--load", str(root / "ckpt"), "--to", "hf", str(root / "hf"),
                                    "--tokenizer-model", str(spm_model), "--no-progress"]) == 0
    inp = root / "in.jsonl"
    inp.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in TEXTS),
                   encoding="utf-8")
    return root / "ckpt", root / "hf", inp, model, tok


def run_cli(export, spm_model, out, flags, max_new_tokens):
    """The command's records (megatron.generate's main, here)."""
    ckpt, _, inp, _, _ = export
    assert generate.main(["--load", str(ckpt), "--tokenizer-model", str(spm_model),
                          "--input", str(inp), "--output", str(out), "--micro-batch-size",
                          str(MICRO_BATCH), "--max-new-tokens", str(max_new_tokens),
                          *flags]) == 0
    return [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]


def transformers_generate(hf, tok, settings, max_new_tokens):
    """(ids, beam scores or []) of transformers' generate, micro-batch by micro-batch."""
    settings = dict(settings)
    seed = settings.pop("seed", None)
    if settings.get("do_sample"):  # the command's top-k is off by default, transformers' 50
        settings.setdefault("top_k", 0)
    rows, scores = [], []
    for first in range(0, len(TEXTS), MICRO_BATCH):
        ids, mask = padded(tok, TEXTS[first:first + MICRO_BATCH])
        if seed is not None:
            torch.manual_seed(seed + first)  # the command's seed for this micro-batch
        with torch.no_grad():
            out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                              decoder_start_token_id=tok.pad_id, eos_token_id=tok.eos_id,
                              pad_token_id=tok.pad_id, return_dict_in_generate=True,
                              output_scores=True, use_cache=False,  # (as ours: no cache)
                              **{"do_sample": False, **settings})
        for row in out.sequences[:, 1:].tolist():
            rows.append(row[:row.index(tok.eos_id) + 1] if tok.eos_id in row else row)
        if settings.get("num_beams", 1) > 1:
            scores += out.sequences_scores.tolist()
    return rows, scores


def test_each_decoding_flag_gives_transformers_generate(export, spm_model, tmp_path):
    from transformers import T5ForConditionalGeneration

    hf = T5ForConditionalGeneration.from_pretrained(export[1]).eval()
    tok = export[4]
    got = {}
    for name, (flags, settings, max_new_tokens) in CASES.items():
        records = run_cli(export, spm_model, tmp_path / f"{name}.jsonl", flags, max_new_tokens)
        ids, scores = transformers_generate(hf, tok, settings, max_new_tokens)
        assert [r["ids"] for r in records] == ids, name
        if scores:
            assert [r["score"] for r in records] == pytest.approx(scores, rel=1e-5), name
        got[name] = [(r["ids"], r.get("score")) for r in records]
    for a, b in DIFFER:
        assert got[a] != got[b], (a, b)
    lengths = [len(ids) for ids, _ in got["greedy"]]
    assert max(lengths) == LONG > min(lengths), lengths  # the limit, and EOS before it


def test_dtype_and_attention_backend_reach_decoding(export, spm_model, tmp_path, monkeypatch):
    ckpt, _, _, model, tok = export
    flags = ["--num-beams", "2"]
    fp32 = run_cli(export, spm_model, tmp_path / "fp32.jsonl", flags, 12)
    bf16 = run_cli(export, spm_model, tmp_path / "bf16.jsonl", [*flags, "--dtype", "bf16"], 12)
    copy = T5Model(T5Config(**TINY), make_vocab_size_divisible_by=128,
                   dtype=torch.bfloat16).eval()
    load_full_state_dict(copy, gather_full_state_dict(model))
    want = []
    for first in range(0, len(TEXTS), MICRO_BATCH):
        ids, mask = padded(tok, TEXTS[first:first + MICRO_BATCH])
        want += beam_search(Decoder(copy, ids, mask, expand=2), ids.shape[0],
                            SpecialTokens(tok.pad_id, tok.eos_id, tok.pad_id),
                            DecodingSettings(max_new_tokens=12, num_beams=2))
    assert [(r["ids"], r["score"]) for r in bf16] == [(h.ids, h.score) for h in want]
    assert [r["score"] for r in bf16] != [r["score"] for r in fp32]

    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting(*args, **kwargs):
        calls.append(1)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
    for backend in ("eager", "sdpa"):
        calls.clear()
        records = run_cli(export, spm_model, tmp_path / f"{backend}.jsonl",
                          [*flags, "--attention-backend", backend], 12)
        assert bool(calls) == (backend == "sdpa"), backend
        assert [r["ids"] for r in records] == [r["ids"] for r in fp32]
        assert [r["score"] for r in records] == pytest.approx([r["score"] for r in fp32],
                                                              rel=1e-5)
