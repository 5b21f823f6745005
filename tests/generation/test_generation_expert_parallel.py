"""Generation at expert-parallel size 2 (gloo): a tiny SwitchTransformers model (switch
router, 4 experts) read into our checkpoint (`--from hf`), decoded by `python -m
megatron.generate` at EP 1 and at EP 2 (each rank holds 2 experts and decodes its own
micro-batches, in lockstep: one rank has a micro-batch more, and outputs end at different
steps), and exported again with our `--to hf` writer: transformers'
SwitchTransformersForConditionalGeneration.generate on that folder gives the same ids."""

import json

import pytest
import torch
from harness import run_workers

pytestmark = pytest.mark.slow

TEXTS = ["To be, or not to be", "Good morrow, kind sir.", "从前有座山", "The king",
         "Now is the winter of our discontent", "O Romeo"]
MICRO_BATCH = 2  # 3 micro-batches: rank 0 decodes two, rank 1 one and a dummy


def _padded(tokenizer, texts):
    """(ids, mask) of `texts` as megatron.generate batches them: EOS appended, padded."""
    encoded = [tokenizer.encode(t, add_eos=True) for t in texts]
    length = max(map(len, encoded))
    ids = torch.tensor([e + [tokenizer.pad_id] * (length - len(e)) for e in encoded])
    mask = torch.tensor([[1] * len(e) + [0] * (length - len(e)) for e in encoded])
    return ids, mask


def _convert(*argv):
    from data_tools import convert_checkpoint

    assert convert_checkpoint.main([*map(str, argv), "--no-progress"]) == 0


@pytest.fixture(scope="module")
def switch(train_data, tmp_path_factory):
    """(our checkpoint, the `--to hf` export) of a random SwitchTransformers model whose EOS
    logit is raised so that some outputs end before the limit."""
    from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

    from megatron.data.tokenizers.tokenizer import build_tokenizer, resolve_tokenizer

    tokenizer = build_tokenizer(resolve_tokenizer(train_data.spm, None))
    vocab = -(-tokenizer.vocab_size // 128) * 128
    root = tmp_path_factory.mktemp("switch")
    torch.manual_seed(0)
    hf = SwitchTransformersForConditionalGeneration(SwitchTransformersConfig(
        vocab_size=vocab, d_model=32, d_kv=8, d_ff=48, num_heads=4, num_experts=4,
        num_layers=2, num_sparse_encoder_layers=1, num_decoder_layers=2,
        num_sparse_decoder_layers=1, expert_capacity=1000, router_jitter_noise=0.0,
        dropout_rate=0.0, tie_word_embeddings=False, eos_token_id=tokenizer.eos_id,
        pad_token_id=tokenizer.pad_id, decoder_start_token_id=tokenizer.pad_id))
    hf.encoder.embed_tokens = hf.decoder.embed_tokens = hf.shared
    hf.eval()
    with torch.no_grad():
        hf.lm_head.weight.normal_(0, 1.0)
        for name, p in hf.named_parameters():
            if "router" in name:  # a peaked routing: tokens spread over the experts
                p.normal_(0, 0.5)
        # EOS's head row along the decoder's mean output, scaled so that some outputs end
        # before the limit and some do not
        ids, mask = _padded(tokenizer, TEXTS)
        decoder_ids = torch.randint(2, tokenizer.vocab_size, (len(TEXTS), 6),
                                    generator=torch.Generator().manual_seed(9))
        hidden = hf(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids,
                    output_hidden_states=True).decoder_hidden_states[-1]
        mean = hidden.reshape(-1, hidden.shape[-1]).mean(0)
        head = hf.lm_head.weight
        norm = head.norm(dim=1).mean()
        for gain in (1.5, 1.25, 1.75, 1.1, 2.0, 1.0, 2.5):
            head[tokenizer.eos_id] = mean / mean.norm() * norm * gain
            rows = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8,
                               do_sample=False, use_cache=False,
                               decoder_start_token_id=tokenizer.pad_id,
                               eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id)
            ended = [tokenizer.eos_id in row for row in rows[:, 1:].tolist()]
            if any(ended) and not all(ended):
                break
    hf.save_pretrained(root / "source")
    _convert("--from", "hf", root / "source", "--to", "megatron", root / "ckpt")
    _convert("--load", root / "ckpt", "--to", "hf", root / "export", "--tokenizer-model",
             train_data.spm)
    return root / "ckpt", root / "export", tokenizer


def _generate(ckpt, spm, tmp_path, ep, beams, tp=1):
    from generation_workers import run_generate

    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in TEXTS),
                   encoding="utf-8")
    argv = ["--load", str(ckpt), "--tokenizer-model", spm, "--input", str(inp),
            "--output", str(tmp_path / f"out_tp{tp}_ep{ep}_{beams}.jsonl"), "--max-new-tokens", "8",
            "--micro-batch-size", str(MICRO_BATCH), "--num-beams", str(beams),
            "--expert-model-parallel-size", str(ep), "--tensor-model-parallel-size", str(tp)]
    results = run_workers(tp * ep, run_generate, argv, timeout=300)
    assert all(r["code"] == 0 for r in results)
    return [json.loads(line) for line in results[0]["text"].splitlines()]


def _transformers(export, tokenizer, beams):
    from transformers import SwitchTransformersForConditionalGeneration

    hf = SwitchTransformersForConditionalGeneration.from_pretrained(export).eval()
    eos, pad = tokenizer.eos_id, tokenizer.pad_id
    out = []
    for start in range(0, len(TEXTS), MICRO_BATCH):
        ids, mask = _padded(tokenizer, TEXTS[start:start + MICRO_BATCH])
        with torch.no_grad():
            rows = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8,
                               do_sample=False, num_beams=beams, use_cache=False,
                               decoder_start_token_id=pad, eos_token_id=eos, pad_token_id=pad)
        for row in rows[:, 1:].tolist():
            out.append(row[:row.index(eos) + 1] if eos in row else row)
    return out


@pytest.mark.parametrize("beams", [1, 3])
def test_expert_parallel_2_generates_what_transformers_and_ep_1_do(switch, train_data,
                                                                   tmp_path, beams):
    ckpt, export, tokenizer = switch
    one = _generate(ckpt, train_data.spm, tmp_path, 1, beams)
    two = _generate(ckpt, train_data.spm, tmp_path, 2, beams)
    assert len(two) == len(TEXTS)
    assert [(r["ids"], r["text"]) for r in two] == [(r["ids"], r["text"]) for r in one]
    if beams > 1:
        assert [r["score"] for r in two] == pytest.approx([r["score"] for r in one], rel=1e-5)
    assert [r["ids"] for r in two] == _transformers(export, tokenizer, beams)
    if beams == 1:  # the lockstep was exercised: outputs of a micro-batch end at other steps
        lengths = [len(r["ids"]) for r in two]
        assert min(lengths) < 8 == max(lengths), lengths


def test_tensor_parallel_2_by_expert_parallel_2_on_4_processes(switch, train_data, tmp_path):
    """TP 2 x EP 2: each rank holds half of 2 experts' columns; the same ids as transformers."""
    ckpt, export, tokenizer = switch
    four = _generate(ckpt, train_data.spm, tmp_path, 2, 1, tp=2)
    assert [r["ids"] for r in four] == _transformers(export, tokenizer, 1)


def test_flag_refusals():
    from megatron.generate import build_parser, flag_problems

    def problems(world, *flags):
        args = build_parser().parse_args(["--load", "x", "--input", __file__, "--output",
                                          __file__, *flags])
        return flag_problems(args, world)

    assert problems(2, "--expert-model-parallel-size", "2") == []
    assert problems(4, "--expert-model-parallel-size", "2") == []  # TP 2 by default
    assert problems(4, "--expert-model-parallel-size", "2",
                    "--tensor-model-parallel-size", "1") == []  # DP 4: two groups
    assert problems(1, "--expert-model-parallel-size", "2") == [
        "--expert-model-parallel-size 2 does not divide the data-parallel size 1 "
        "(processes 1 / tensor-parallel size 1)"]
    assert problems(4, "--expert-model-parallel-size", "2", "--tensor-model-parallel-size",
                    "4") == ["--expert-model-parallel-size 2 does not divide the data-parallel "
                             "size 1 (processes 4 / tensor-parallel size 4)"]
    assert problems(2, "--tensor-model-parallel-size", "3") == [
        "--tensor-model-parallel-size 3 does not divide the number of processes (2)"]


def test_torchrun_at_expert_parallel_2(switch, train_data, tmp_path):
    """`torchrun --nproc-per-node 2 -m megatron.generate ... --expert-model-parallel-size 2`."""
    import subprocess
    import sys
    from pathlib import Path

    ckpt, export, tokenizer = switch
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in TEXTS),
                   encoding="utf-8")
    out = tmp_path / "out.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--standalone", "-m", "megatron.generate", "--load", str(ckpt),  # its own port
         "--tokenizer-model", train_data.spm, "--input", str(inp), "--output", str(out),
         "--max-new-tokens", "8", "--micro-batch-size", str(MICRO_BATCH),
         "--expert-model-parallel-size", "2"],
        cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    got = [json.loads(line)["ids"] for line in out.read_text(encoding="utf-8").splitlines()]
    assert got == _transformers(export, tokenizer, 1)


def test_checkpoint_refusals(switch):
    from megatron.generate import GenerateError
    from megatron.loaded_model import read_checkpoint

    ckpt = switch[0]
    with pytest.raises(GenerateError, match="does not divide the 4 experts"):
        read_checkpoint(str(ckpt), None, 8)
    assert read_checkpoint(str(ckpt), None, 4)[2].num_experts == 4


def decode_at_ep_2(rank, world_size, router, full, ids, mask):
    """Rank 0 decodes rows 0 and 1, rank 1 row 2 then a dummy input (EP 2, lockstep)."""
    import torch.distributed as dist
    from generation_models import CONFIGS, EOS, PAD

    from megatron.generation import Decoder, DecodingSettings, SpecialTokens, beam_search, \
        greedy
    from megatron.generation.lockstep import Lockstep, dummy_decoder
    from megatron.model import T5Config, T5Model
    from megatron.model.state_dict import load_full_state_dict
    from megatron.tensor_parallel.group import ExpertParallel

    config = T5Config(**CONFIGS["v1_1"], num_experts=4, encoder_sparse_step=2,
                      decoder_sparse_step=2, router_type=router)
    model = T5Model(config, expert_parallel=ExpertParallel(2, rank, dist.group.WORLD))
    load_full_state_dict(model, full)
    model.eval()
    assert model.state_dict()["decoder.block.1.layer.2.mlp.experts.wi_0"].shape[0] == 2
    rows = [0, 1] if rank == 0 else [2]
    group = dist.group.WORLD
    decoder = Lockstep(Decoder(model, ids[rows], mask[rows]), group, PAD)
    tokens = SpecialTokens(start=PAD, eos=EOS, pad=PAD)
    twelve, beams = DecodingSettings(max_new_tokens=12), DecodingSettings(10, num_beams=3)
    out = {"greedy": [h.ids for h in greedy(decoder, len(rows), tokens, twelve)]}
    decoder.drain()
    decoder = Lockstep(Decoder(model, ids[rows], mask[rows], expand=3), group, PAD)
    out["beam"] = [h.ids for h in beam_search(decoder, len(rows), tokens, beams)]
    decoder.drain()
    if rank == 1:  # rank 0's second micro-batch against rank 1's dummy
        Lockstep(dummy_decoder(model, EOS, ids.device), group, PAD).drain()
    else:
        decoder = Lockstep(Decoder(model, ids[:1], mask[:1]), group, PAD)
        out["again"] = [h.ids for h in greedy(decoder, 1, tokens, twelve)]
        decoder.drain()
    return out


@pytest.mark.parametrize("router", ["switch", "topk", "base", "cpm2"])
def test_every_router_at_expert_parallel_2_decodes_what_one_process_does(router):
    from generation_models import CONFIGS, EOS, PAD, padded_batch, sharpen

    from megatron.generation import Decoder, DecodingSettings, SpecialTokens, beam_search, \
        greedy
    from megatron.model import T5Config, T5Model
    from megatron.model.state_dict import gather_full_state_dict

    torch.manual_seed(4)
    config = T5Config(**CONFIGS["v1_1"], num_experts=4, encoder_sparse_step=2,
                      decoder_sparse_step=2, router_type=router)
    model = T5Model(config)
    sharpen(model)
    model.eval()
    ids, mask = padded_batch(seed=5)
    tokens = SpecialTokens(start=PAD, eos=EOS, pad=PAD)
    expected = {"greedy": [h.ids for h in greedy(Decoder(model, ids, mask), 3, tokens,
                                                 DecodingSettings(max_new_tokens=12))],
                "beam": [h.ids for h in beam_search(Decoder(model, ids, mask, expand=3), 3,
                                                    tokens, DecodingSettings(10, num_beams=3))]}
    got = run_workers(2, decode_at_ep_2, router, gather_full_state_dict(model), ids, mask,
                      timeout=300)
    assert got[0]["greedy"] + got[1]["greedy"] == expected["greedy"]
    assert got[0]["beam"] + got[1]["beam"] == expected["beam"]
    assert got[0]["again"] == expected["greedy"][:1]
