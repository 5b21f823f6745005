"""Worker functions for the pipeline generation tests (run by tests/distributed/harness.py on
gloo)."""

import torch


def decode_pipeline(rank, world_size, cases, ids, mask, beam_flags):
    """For each case (config name, full state dict, stage boundaries or None, split rank):
    greedy, sampled and beam-search ids of a pipeline of world_size stages, this rank's stage
    and the names of the parameters it holds (not on the meta device)."""
    from generation_models import CONFIGS, EOS, PAD

    from megatron import parallel_state
    from megatron.generation import (DecodingSettings, SpecialTokens, beam_search, greedy,
                                     sample)
    from megatron.generation.pipeline import PipelineDecoder
    from megatron.generation.stage import build_stage, pipeline_of_this_process
    from megatron.model import T5Config
    from megatron.pipeline.partition import Cut, cut_model
    from megatron.tensor_parallel.group import ExpertParallel, TensorParallel

    parallel_state.initialize_model_parallel(1, world_size)
    stage, ranks, group = pipeline_of_this_process()
    out = []
    for name, full, blocks, split in cases:
        config = T5Config(**CONFIGS[name])
        cut = cut_model(config, world_size, split) if blocks is None else \
            Cut(config.num_layers, config.num_decoder_layers, tuple(blocks), None,
                (0.0,) * world_size)
        held = build_stage(config, cut, stage, full.items(), make_vocab_size_divisible_by=128,
                           backend="auto", tp=TensorParallel.of_this_process(),
                           ep=ExpertParallel.of_this_process(), device="cpu",
                           dtype=torch.float32, ranks=ranks, group=group)
        found = {"blocks": cut.blocks, "stage": stage,
                 "held": sorted(n for n, p in held.model.named_parameters() if not p.is_meta)}
        tokens = SpecialTokens(start=PAD, eos=EOS, pad=PAD)
        found["greedy"] = [h.ids for h in greedy(PipelineDecoder(held, ids, mask), ids.shape[0],
                                                 tokens, DecodingSettings(max_new_tokens=12))]
        sampling = DecodingSettings(max_new_tokens=8, do_sample=True, top_k=20, seed=5)
        found["sample"] = [h.ids for h in sample(PipelineDecoder(held, ids, mask), ids.shape[0],
                                                 tokens, sampling)]
        beams = beam_search(PipelineDecoder(held, ids, mask, expand=beam_flags["num_beams"]),
                            ids.shape[0], tokens,
                            DecodingSettings(max_new_tokens=10, **beam_flags))
        found["beam"] = [h.ids for h in beams]
        found["scores"] = torch.tensor([h.score for h in beams])
        out.append(found)
    return out


def run_generate_each(rank, world_size, argvs):
    """megatron.generate's main on every rank, once per argv (one process start for all);
    rank 0 returns each output file's text."""
    from pathlib import Path

    from megatron import generate

    out = []
    for argv in argvs:
        code = generate.main(argv)
        path = Path(argv[argv.index("--output") + 1])
        out.append({"code": code,
                    "text": path.read_text(encoding="utf-8") if rank == 0 else None})
    return out
