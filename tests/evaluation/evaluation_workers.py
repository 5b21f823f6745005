"""Requests and models the evaluation tests share, and the workers of their multi-process
runs (tests/distributed/harness.py's run_workers)."""

import torch

MOE = dict(num_experts=4, encoder_sparse_step=2, decoder_sparse_step=2)
CONTEXTS = ["To be, or not to be: that is the", "Good morrow, kind ", "从前有座山，山里有座",
            "The king is", "Now is the winter of our discontent made glorious",
            "O Romeo, Romeo, wherefore art thou", "Friends, Romans, countrymen, lend me"]
CONTINUATIONS = [" question", "sir.", "庙", " dead, long live the king", " summer", " Romeo?",
                 " your ears"]


def moe_model(router: str, vocab_size: int, expert_parallel=None):
    """A tiny T5 v1.1 with a sparse block in each stack routed by `router` (random weights,
    the embedding sharpened: peaked outputs), in evaluation mode."""
    from generation_models import CONFIGS, sharpen

    from megatron.model import T5Config, T5Model

    torch.manual_seed(4)
    fields = dict(CONFIGS["v1_1"], vocab_size=vocab_size)
    config = T5Config(**fields, **MOE, router_type=router)
    kw = {} if expert_parallel is None else {"expert_parallel": expert_parallel}
    model = T5Model(config, **kw)
    sharpen(model)
    return model.eval()


def requests(kind: str):
    """The harness's Instances of one request type over CONTEXTS (CONTINUATIONS)."""
    from lm_eval.api.instance import Instance

    out = []
    for i, (context, continuation) in enumerate(zip(CONTEXTS, CONTINUATIONS)):
        if kind == "loglikelihood":
            arguments = (context, continuation)
        elif kind == "generate_until":
            # max_length (transformers' decoder length, start token included): the same bound
            # in any batch (by default the batch's padded context length counts, harness_lm.py)
            arguments = (context, {"until": ["."], "max_length": 7, "do_sample": False})
        else:
            arguments = (context + continuation,)
        out.append(Instance(request_type=kind, doc={}, arguments=arguments, idx=i))
    return out


def answers(lm, rank: int = 0, size: int = 1):
    """{request type: this rank's answers}: every `size`-th request from `rank` on, as the
    harness's evaluator splits documents over data-parallel ranks."""
    return {kind: getattr(lm, kind)(requests(kind)[rank::size])
            for kind in ("loglikelihood", "generate_until", "loglikelihood_rolling")}


def moe_answers_at_ep_2(rank, world_size, router, full, spm, batch_size):
    """`answers` of the router's model at expert-parallel size 2 over the 2 data-parallel
    ranks (each holds 2 of the 4 experts; rank 0 has one request more)."""
    import torch.distributed as dist

    from megatron.data.tokenizers.tokenizer import build_tokenizer, resolve_tokenizer
    from megatron.evaluation.harness_lm import MegatronT5LM
    from megatron.model.state_dict import load_full_state_dict
    from megatron.tensor_parallel.group import ExpertParallel

    tokenizer = build_tokenizer(resolve_tokenizer(spm, None))
    model = moe_model(router, tokenizer.vocab_size,
                      ExpertParallel(2, rank, dist.group.WORLD))
    load_full_state_dict(model, full)
    model.eval()
    lm = MegatronT5LM(model, tokenizer, batch_size=batch_size, max_length=64,
                      data_group=dist.group.WORLD, expert_group=dist.group.WORLD)
    assert (lm.rank, lm.world_size) == (rank, 2)
    return answers(lm, rank, 2)


def run_evaluate(rank, world_size, argv):
    """megatron.evaluate's main on every rank: (its exit status, the experts this rank's model
    holds in each sparse layer, whether its LM runs in lockstep over an expert group)."""
    from megatron import evaluate
    from megatron.evaluation.harness_lm import MegatronT5LM

    seen = {}
    init = MegatronT5LM.__init__

    def spying(self, model, tokenizer, **kw):
        seen["experts"] = sorted({t.shape[0] for name, t in model.state_dict().items()
                                  if name.endswith("experts.wi_0")})
        seen["lockstep"] = kw.get("expert_group") is not None
        init(self, model, tokenizer, **kw)

    MegatronT5LM.__init__ = spying
    try:
        return evaluate.main(argv), seen["experts"], seen["lockstep"]
    finally:
        MegatronT5LM.__init__ = init
