"""Generation over pipeline stages (gloo, 2 processes): greedy, sampled and beam-search ids at
PP 2 equal one process's on the same weights, whatever the cut, and a stage holds exactly its
parts."""

import json
from pathlib import Path

import pytest
import torch
from generation_models import EOS, PAD, our_model, padded_batch, same_outputs
from harness import run_workers

from megatron.generation import (Decoder, DecodingSettings, SpecialTokens, beam_search, greedy,
                                 sample)
from megatron.model.state_dict import gather_full_state_dict

BEAMS = dict(num_beams=3, length_penalty=0.8, early_stopping=False, no_repeat_ngram_size=2)


def one_process(model, ids, mask):
    """What pipeline_workers.decode_pipeline decodes, by one process with the whole model."""
    tokens = SpecialTokens(start=PAD, eos=EOS, pad=PAD)
    beams = beam_search(Decoder(model, ids, mask, expand=BEAMS["num_beams"]), ids.shape[0],
                        tokens, DecodingSettings(max_new_tokens=10, **BEAMS))
    sampling = DecodingSettings(max_new_tokens=8, do_sample=True, top_k=20, seed=5)
    return {"greedy": [h.ids for h in greedy(Decoder(model, ids, mask), ids.shape[0], tokens,
                                             DecodingSettings(max_new_tokens=12))],
            "sample": [h.ids for h in sample(Decoder(model, ids, mask), ids.shape[0], tokens,
                                             sampling)],
            "beam": [h.ids for h in beams],
            "scores": torch.tensor([h.score for h in beams])}


TABLE = "block.0.layer.0.SelfAttention.relative_attention_bias"
PARTS = [  # each case's stages' parts, by hand from docs/generation.md's list
    # v1_0 (tied; 2 + 2 blocks) cut (0, 1, 4)
    (["shared", "encoder.block.0"],
     ["shared", f"encoder.{TABLE}", "encoder.block.1", "encoder.final_layer_norm",
      "decoder.block.0", "decoder.block.1", "decoder.final_layer_norm"]),
    # v1_1 (untied; 2 + 3 blocks) cut (0, 3, 5)
    (["shared", "encoder.block.0", "encoder.block.1", "encoder.final_layer_norm",
      "decoder.block.0"],
     [f"decoder.{TABLE}", "decoder.block.1", "decoder.block.2", "decoder.final_layer_norm",
      "lm_head"]),
    # v1_1 split rank 1: cut (0, 2, 5)
    (["shared", "encoder.block.0", "encoder.block.1", "encoder.final_layer_norm"],
     ["shared", "decoder.block.0", "decoder.block.1", "decoder.block.2",
      "decoder.final_layer_norm", "lm_head"]),
]


def held_parameters(model, parts):
    """The names of `model`'s parameters under the modules `parts`, sorted."""
    return sorted(n for n, _ in model.named_parameters()
                  if any(n == p or n.startswith(p + ".") for p in parts))


@pytest.mark.slow
def test_pipeline_search_equals_one_process():
    """Cuts: v1_0 (tied) (0, 1, 4): stage 1 holds the encoder's last block (and its bias table,
    block 0's), the whole decoder and the tied head; v1_1 (0, 3, 5): stage 0 holds the encoder
    and decoder block 0, stage 1 the decoder's later blocks (and its table); v1_1 with split
    rank 1: the encoder on stage 0, the decoder on stage 1. A padded batch."""
    from pipeline_workers import decode_pipeline

    ids, mask = padded_batch(seed=3)
    models = {name: our_model(name, seed=3) for name in ("v1_0", "v1_1")}
    full = {name: gather_full_state_dict(model) for name, model in models.items()}
    cases = [("v1_0", full["v1_0"], None, None), ("v1_1", full["v1_1"], (0, 3, 5), None),
             ("v1_1", full["v1_1"], None, 1)]
    got = run_workers(2, decode_pipeline, cases, ids, mask, BEAMS, timeout=300)
    assert [c["blocks"] for c in got[0]] == [(0, 1, 4), (0, 3, 5), (0, 2, 5)]
    want = {name: one_process(model, ids, mask) for name, model in models.items()}
    for rank in got:
        for case, ((name, *_), found) in enumerate(zip(cases, rank)):
            assert found["held"] == held_parameters(models[name], PARTS[case][found["stage"]]), \
                (name, found["blocks"], found["stage"])
            for key in ("greedy", "sample", "beam"):
                assert found[key] == want[name][key], (name, found["blocks"], key)
            torch.testing.assert_close(found["scores"], want[name]["scores"], rtol=1e-5,
                                       atol=1e-5)


TEXTS = ["To be, or not to be", "Good morrow, kind sir.", "从前有座山"]


def cli_argvs(ckpt, spm, tmp_path, tag, *extra, beams=("1", "2")):
    """megatron.generate's argv for TEXTS, once per beam count, each with its own output."""
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in TEXTS),
                   encoding="utf-8")
    return [["--load", str(ckpt), "--tokenizer-model", spm, "--input", str(inp),
             "--output", str(tmp_path / f"{tag}_{b}.jsonl"), "--max-new-tokens", "6",
             "--num-beams", b, *extra] for b in beams]


def one_process_texts(argvs):
    """Each argv's OUT.jsonl text, decoded here by one process."""
    from megatron import generate

    out = []
    for argv in argvs:
        assert generate.main(argv) == 0
        out.append(Path(argv[argv.index("--output") + 1]).read_text(encoding="utf-8"))
    return out


@pytest.mark.slow
def test_a_pipeline_checkpoint_decodes_at_pp_2(train_data, pipeline_trained, tmp_path):
    """`python -m megatron.generate` on a 2-stage pipeline run's checkpoint: at PP 2 (its
    default cut, stage 1 holding the encoder's last block and the decoder; and with
    --pipeline-model-parallel-split-rank 1) the ids, text and scores of one process."""
    from pipeline_workers import run_generate_each

    def argvs(tag, *extra):
        return cli_argvs(pipeline_trained, train_data.spm, tmp_path, tag,
                         "--micro-batch-size", "3", *extra)

    want = one_process_texts(argvs("pp1"))
    got = run_workers(2, run_generate_each,
                      argvs("pp2", "--pipeline-model-parallel-size", "2") +
                      argvs("split", "--pipeline-model-parallel-size", "2",
                            "--pipeline-model-parallel-split-rank", "1"), timeout=300)[0]
    assert all(r["code"] == 0 for r in got)
    assert all(len(text.splitlines()) == len(TEXTS) for text in want)
    for found, text in zip(got, want + want):
        same_outputs(found["text"], text)


@pytest.mark.slow
def test_pipeline_with_tensor_data_and_expert_parallel(train_data, pipeline_trained, tmp_path):
    """4 processes: PP 2 x TP 2; PP 2 x DP 2 (one pipeline decodes two micro-batches, the
    other one); PP 2 x EP 2 on a Mixture-of-Experts checkpoint (each stage's two data ranks
    decode in lockstep, one with a dummy micro-batch): one process's outputs."""
    from pipeline_workers import run_generate_each

    from megatron.checkpoint.formats.weights import write_weights_checkpoint
    from megatron.model import T5Config, T5Model

    torch.manual_seed(0)
    config = T5Config(vocab_size=4100, d_model=32, d_kv=8, d_ff=48, num_layers=2,
                      num_decoder_layers=2, num_heads=4, feed_forward_proj="gated-gelu",
                      tie_word_embeddings=False, dropout_rate=0.0, num_experts=4)
    moe = T5Model(config, make_vocab_size_divisible_by=1).eval()
    with torch.no_grad():
        moe.shared.weight.mul_(3.0)
        moe.lm_head.weight.mul_(3.0)
    write_weights_checkpoint(tmp_path / "moe", gather_full_state_dict(moe).items(),
                             {"config": config.to_dict(), "make_vocab_size_divisible_by": 128})
    spm = train_data.spm
    cases = [(pipeline_trained, "tp", ("2",), ["--micro-batch-size", "3"],
              ["--tensor-model-parallel-size", "2"]),
             (pipeline_trained, "dp", ("1",), ["--micro-batch-size", "1"],
              ["--tensor-model-parallel-size", "1"]),
             (tmp_path / "moe", "ep", ("1", "2"), ["--micro-batch-size", "1"],
              ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "1"])]
    want, argvs = [], []
    for ckpt, tag, beams, batch, parallel in cases:
        want += one_process_texts(cli_argvs(ckpt, spm, tmp_path, f"{tag}1", *batch,
                                            beams=beams))
        argvs += cli_argvs(ckpt, spm, tmp_path, f"{tag}4", *batch, *parallel,
                           "--pipeline-model-parallel-size", "2", beams=beams)
    got = run_workers(4, run_generate_each, argvs, timeout=300)[0]
    assert all(r["code"] == 0 for r in got)
    for found, text in zip(got, want):
        same_outputs(found["text"], text)


def test_pipeline_flags_are_checked():
    from megatron.generate import GenerateError, build_parser, flag_problems
    from megatron.loaded_model import pipeline_cut
    from megatron.model import T5Config

    def args(*flags):
        return build_parser().parse_args(["--load", "x", "--input", __file__, "--output",
                                          __file__, *flags])

    pp2 = ("--pipeline-model-parallel-size", "2")
    assert flag_problems(args(*pp2), 2) == []
    assert flag_problems(args(*pp2), 8) == []  # TP 4 by default
    assert flag_problems(args(*pp2, "--expert-model-parallel-size", "2"), 8) == []  # TP 2
    assert flag_problems(args(*pp2), 3) == [
        "--tensor-model-parallel-size 1 x --pipeline-model-parallel-size 2 does not divide the "
        "number of processes (3)"]
    assert flag_problems(args(*pp2, "--expert-model-parallel-size", "2",
                              "--tensor-model-parallel-size", "2"), 4) == [
        "--expert-model-parallel-size 2 does not divide the data-parallel size 1 (processes 4 "
        "/ tensor-parallel size 2 / pipeline-parallel size 2)"]
    assert flag_problems(args("--pipeline-model-parallel-split-rank", "1"), 1) == [
        "--pipeline-model-parallel-split-rank 1 needs --pipeline-model-parallel-size > 1"]
    config = T5Config(vocab_size=300, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                      num_decoder_layers=1, num_heads=4)
    assert pipeline_cut(config, args()) is None
    assert pipeline_cut(config, args(*pp2)).stages == 2
    with pytest.raises(GenerateError, match="larger than the model's 3 blocks"):
        pipeline_cut(config, args("--pipeline-model-parallel-size", "4"))
    with pytest.raises(GenerateError, match="the decoder has 1 blocks, too few for 2 stages"):
        pipeline_cut(config, args("--pipeline-model-parallel-size", "3",
                                  "--pipeline-model-parallel-split-rank", "1"))


def test_a_stage_starting_mid_encoder_computes_the_stack_bias_itself():
    """T5Model.encoder_position_bias, as a stage holding encoder block 1 but not block 0 uses it
    (the relative bias is never sent): the bias block 0 computed for the stack, and block 1 on
    block 0's output with it gives the encoder output of one process (fp32, a padded batch)."""
    model = our_model("v1_0", seed=2)
    ids, mask = padded_batch(seed=2)
    with torch.no_grad():
        want, _ = model.encode(ids, mask)
        carry = model.initial_carry(ids, ids[:, :1], mask)
        carry = model.run_layers(carry, [model.embed_encoder, model.encoder.block[0]])
        bias = model.encoder_position_bias(carry.hidden, carry.encoder_mask)
        assert torch.equal(bias, carry.position_bias)
        carry = carry._replace(position_bias=bias)
        carry = model.finish_encoder(model.run_layers(carry, [model.encoder.block[1]]))
    torch.testing.assert_close(carry.encoder_output, want, rtol=1e-6, atol=1e-6)


def test_the_shape_header_holds_at_most_seven_dimensions():
    """megatron/pipeline/comm.py refuses (before sending anything) what its header cannot
    say."""
    from megatron.pipeline.comm import send_tensors

    with pytest.raises(ValueError, match="8-dimensional tensor: at most 7"):
        send_tensors([torch.zeros([1] * 8)], dst=1)
