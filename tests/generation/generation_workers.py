"""Worker functions for the multi-process generation tests (run by tests/distributed/harness.py
on gloo)."""

import torch
import torch.distributed as dist


def decode_tensor_parallel(rank, world_size, name, full, ids, mask, beam_flags, sampling):
    """Greedy, sampled (`sampling`: DecodingSettings' sampling fields) and beam-search ids of a TP =
    world_size model holding `full`'s weights."""
    from generation_models import CONFIGS, EOS, PAD

    from megatron.generation import (Decoder, DecodingSettings, SpecialTokens, beam_search,
                                     greedy, sample)
    from megatron.model import T5Config, T5Model
    from megatron.model.state_dict import load_full_state_dict
    from megatron.tensor_parallel.group import TensorParallel

    tp = TensorParallel(world_size, rank, dist.group.WORLD)
    model = T5Model(T5Config(**CONFIGS[name]), tensor_parallel=tp)
    load_full_state_dict(model, full)
    model.eval()
    tokens = SpecialTokens(start=PAD, eos=EOS, pad=PAD)
    out = {"greedy": [h.ids for h in greedy(Decoder(model, ids, mask), ids.shape[0], tokens,
                                            DecodingSettings(max_new_tokens=12))]}
    sampled = DecodingSettings(max_new_tokens=12, do_sample=True, **sampling)
    out["sample"] = [h.ids for h in sample(Decoder(model, ids, mask), ids.shape[0], tokens,
                                           sampled)]
    beams = beam_search(Decoder(model, ids, mask, expand=beam_flags["num_beams"]),
                        ids.shape[0], tokens, DecodingSettings(max_new_tokens=10, **beam_flags))
    out["beam"] = [h.ids for h in beams]
    out["scores"] = torch.tensor([h.score for h in beams])
    return out


def run_generate(rank, world_size, argv):
    """megatron.generate's main on every rank; rank 0 returns its output file's text."""
    from pathlib import Path

    from megatron import generate

    code = generate.main(argv)
    out = Path(argv[argv.index("--output") + 1])
    return {"code": code, "text": out.read_text(encoding="utf-8") if rank == 0 else None}


def run_pretrain_keeping_shards(rank, world_size, argv):
    """train_workers.run_pretrain of `argv`, then this rank's trained parameters as the
    training module holds them (not read back from the checkpoint): {name: (shard,
    partition dim or None, partition stride)}."""
    from train_workers import built_steps, run_pretrain

    with built_steps() as built:
        run_pretrain(rank, world_size, [argv])
    module = built[-1].reporting_module()
    return {name: (p.detach().clone().float(),
                   p.partition_dim if getattr(p, "tensor_model_parallel", False) else None,
                   getattr(p, "partition_stride", 1))
            for name, p in module.named_parameters()}


def run_pretrain_keeping_whole_model(rank, world_size, argv):
    """The entry point's pretrain of `argv`, then the tensors this rank's trained module holds
    under the single-process model's names (train_workers.decoding_state: in a pipeline its
    stage's parts), taken before the process groups go (not read back from the checkpoint)."""
    import os

    from train_workers import built_steps, decoding_state

    from megatron import parallel_state
    from megatron.arguments import parse_args
    from megatron.initialize import initialize_distributed
    from megatron.pretrain_t5 import pretrain

    config = parse_args(argv, env=os.environ)
    initialize_distributed(config.runtime, config.parallel)
    try:
        with built_steps() as built:
            pretrain(config)
        return decoding_state(built[-1].reporting_module(), config)[0]
    finally:
        parallel_state.destroy_model_parallel()
