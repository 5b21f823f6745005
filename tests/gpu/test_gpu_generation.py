"""On one CUDA GPU (`make gpu-check`; skipped with "needs CUDA" elsewhere): decoding
(megatron/generation, `python -m megatron.generate`) on CUDA against the same decoding on the
CPU: greedy and beam-search ids equal in fp32 (beam scores to 1e-4 relative), the KV-cached
steps in bf16 follow the plain forward's logits, and the command, which picks CUDA by itself,
writes the CPU's ids."""

import json

import pytest
import torch

pytestmark = pytest.mark.gpu

VOCAB, EOS, PAD = 300, 1, 0
FIELDS = dict(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2,
              num_decoder_layers=3, num_heads=4, feed_forward_proj="gated-gelu",
              tie_word_embeddings=False, dropout_rate=0.0)


def tiny_model(fields=FIELDS, seed=0):
    """A random model whose next-token distributions are peaked (scaled embedding and head),
    so that greedy and beam search are not decided by rounding."""
    from megatron.model import T5Config, T5Model

    torch.manual_seed(seed)
    model = T5Model(T5Config(**fields), make_vocab_size_divisible_by=1).eval()
    with torch.no_grad():
        model.shared.weight.mul_(3.0)
        model.lm_head.weight.mul_(3.0)
    return model


def on_cuda(model, dtype=torch.float32):
    from megatron.model import T5Model

    copy = T5Model(model.config, make_vocab_size_divisible_by=1, device="cuda", dtype=dtype)
    copy.load_state_dict(model.state_dict())
    return copy.eval()


def padded_batch(device):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(2, VOCAB, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    for row, length in enumerate((9, 6, 4)):
        ids[row, length:] = PAD
        mask[row, length:] = 0
    return ids.to(device), mask.to(device)


def test_greedy_and_beam_search_on_cuda_give_the_cpu_ids():
    from megatron.generation import Decoder, DecodingSettings, SpecialTokens, beam_search, \
        greedy

    cpu = tiny_model()
    gpu = on_cuda(cpu)
    found = {}
    tokens = SpecialTokens(start=PAD, eos=EOS, pad=PAD)
    for device, model in (("cpu", cpu), ("cuda", gpu)):
        ids, mask = padded_batch(device)
        found[device] = (
            greedy(Decoder(model, ids, mask), 3, tokens, DecodingSettings(max_new_tokens=16),
                   device=device),
            beam_search(Decoder(model, ids, mask, expand=4), 3, tokens,
                        DecodingSettings(max_new_tokens=12, num_beams=4), device=device))
    for want, got in zip(found["cpu"], found["cuda"]):
        assert [h.ids for h in got] == [h.ids for h in want]
    assert [h.score for h in found["cuda"][1]] == pytest.approx(
        [h.score for h in found["cpu"][1]], rel=1e-4)


def test_cached_steps_in_bf16_on_cuda_follow_the_full_forward():
    from megatron.generation import Decoder

    model = on_cuda(tiny_model(), torch.bfloat16)
    ids, mask = padded_batch("cuda")
    dec = torch.cat([torch.full((3, 1), PAD), torch.randint(2, VOCAB, (3, 7))], dim=1).cuda()
    decoder = Decoder(model, ids, mask)
    with torch.no_grad():
        full = model(ids, dec, mask).logits[..., :VOCAB].float()
    for t in range(dec.shape[1]):
        step = decoder.step(dec[:, t])
        # bf16 (8 bits): the cached and the full computation round differently; 2^-5 of the
        # logits' scale bounds a few roundings of each, and the argmax must agree
        scale = full[:, t].abs().max()
        assert (step - full[:, t]).abs().max() <= 2.0 ** -5 * scale, t
        assert torch.equal(step.argmax(-1), full[:, t].argmax(-1)), t


def test_the_command_decodes_on_cuda_as_on_the_cpu(spm_model, tmp_path):
    from megatron import generate
    from megatron.checkpoint.formats.weights import write_weights_checkpoint
    from megatron.data.tokenizers.tokenizer import T5Tokenizer
    from megatron.generation import Decoder, DecodingSettings, SpecialTokens, greedy
    from megatron.model import T5Config
    from megatron.model.state_dict import gather_full_state_dict

    fields = dict(FIELDS, vocab_size=4100)
    model = tiny_model(fields)
    ckpt = tmp_path / "ckpt"
    write_weights_checkpoint(ckpt, gather_full_state_dict(model).items(),
                             {"config": T5Config(**fields).to_dict(),
                              "make_vocab_size_divisible_by": 128})
    texts = ["To be, or not to be: that is the question.", "床前明月光"]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts),
                   encoding="utf-8")
    assert generate.main(["--load", str(ckpt), "--tokenizer-model", str(spm_model),
                          "--input", str(inp), "--output", str(out), "--max-new-tokens", "12",
                          "--micro-batch-size", "1"]) == 0
    got = [json.loads(line)["ids"] for line in out.read_text(encoding="utf-8").splitlines()]
    tok = T5Tokenizer(str(spm_model))
    want = []
    for text in texts:
        ids = torch.tensor([tok.encode(text, add_eos=True)])
        want += [h.ids for h in greedy(Decoder(model, ids, torch.ones_like(ids)), 1,
                                       SpecialTokens(tok.pad_id, tok.eos_id, tok.pad_id),
                                       DecodingSettings(max_new_tokens=12))]
    assert got == want
