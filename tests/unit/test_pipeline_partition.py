"""The pipeline cut (megatron/pipeline/partition.py), checked by hand; DeepSpeed's pipeline
topology against our rank layout; per-layer initial weights that do not depend on which layers
a process builds."""

import pytest
import torch

from megatron.model.config import T5Config
from megatron.model.flops import forward_flops_per_sample
from megatron.parallel_state import make_layout
from megatron.pipeline.partition import bubble_fraction, cut_model, cut_problems


def config(**kw):
    base = dict(vocab_size=4100, d_model=32, d_kv=8, d_ff=64, num_layers=4,
                num_decoder_layers=4, num_heads=4, feed_forward_proj="gated-gelu")
    return T5Config(**{**base, **kw})


def test_split_rank_puts_the_encoder_below_it_and_spreads_each_side_evenly():
    cut = cut_model(config(num_layers=4, num_decoder_layers=6), 4, split_rank=2)
    assert cut.blocks == (0, 2, 4, 7, 10)
    assert [tuple(map(list, cut.stage_blocks(s))) for s in range(4)] == [
        ([0, 1], []), ([2, 3], []), ([], [0, 1, 2]), ([], [3, 4, 5])]


def test_the_cost_cut_gives_decoder_blocks_fewer_per_stage_and_balances_by_hand():
    c = config(num_layers=6, num_decoder_layers=6)
    cut = cut_model(c, 2, enc_len=512, dec_len=512, vocab_size=4224)
    parts = forward_flops_per_sample(c, 512, 512, 4224)
    enc = parts["encoder"] / 6
    dec = (parts["decoder"] + parts["cross_kv"]) / 6
    assert dec > enc  # cross-attention and its K/V projections
    # every contiguous cut of 12 blocks into 2, by hand: the one with the smallest maximum
    embed = (512 + 512) * c.d_model

    def cost(b):
        first = sum([enc] * min(b, 6) + [dec] * max(b - 6, 0)) + embed
        second = sum([enc] * max(6 - b, 0) + [dec] * (12 - max(b, 6))) + parts["lm_head"]
        return max(first, second)
    best = min(range(1, 12), key=cost)
    assert cut.blocks == (0, best, 12)
    assert best > 6  # the decoder-heavy second half holds fewer blocks
    assert cut.split_rank is None
    assert sum(cut.stage_costs) == pytest.approx(6 * enc + 6 * dec + embed + parts["lm_head"])


def test_describe_names_every_part_once():
    lines = cut_model(config(num_layers=2, num_decoder_layers=2), 2).describe()
    assert lines[0] == "pipeline: 2 stages, cut by layer cost"
    text = "\n".join(lines)
    assert lines[1].startswith("  stage 0: embedding, encoder blocks 0-1")
    for part in ("encoder final norm", "decoder embedding", "LM head"):
        assert text.count(part) == 1, part


def test_problems_name_the_flags():
    c = config(num_layers=2, num_decoder_layers=2)
    assert cut_problems(c, 4, None) == []
    assert "every stage needs a block" in cut_problems(c, 5, None)[0]
    assert "1 .. 3" in cut_problems(c, 4, 4)[0]
    assert "encoder has 2 blocks" in cut_problems(c, 4, 3)[0]
    assert "--pipeline-model-parallel-size > 1" in cut_problems(c, 1, 1)[0]
    with pytest.raises(ValueError, match="split-rank"):
        cut_model(c, 2, split_rank=0)


@pytest.mark.parametrize("p,m,want", [(2, 1, 0.5), (4, 4, 3 / 7), (4, 8, 3 / 11), (1, 3, 0.0)])
def test_bubble(p, m, want):
    assert bubble_fraction(p, m) == pytest.approx(want)


@pytest.mark.parametrize("tp,pp,dp", [(2, 2, 2), (4, 4, 2), (1, 2, 3), (2, 3, 1)])
def test_our_groups_are_deepspeeds_pipeline_topology(tp, pp, dp):
    """parallel_state's tensor, data and pipeline groups equal the comm lists of DeepSpeed's
    PipeModelDataParallelTopology (axes pipe, data, model) for every rank."""
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    layout = make_layout(tp * pp * dp, 0, tp, pp)
    assert sorted(layout.tensor_group_ranks()) == sorted(topo.get_axis_comm_lists("model"))
    assert sorted(layout.data_group_ranks()) == sorted(topo.get_axis_comm_lists("data"))
    assert sorted(layout.pipeline_group_ranks()) == sorted(topo.get_axis_comm_lists("pipe"))
    for rank in range(tp * pp * dp):
        coord = topo.get_coord(rank)
        mine = make_layout(tp * pp * dp, rank, tp, pp)
        assert (mine.pipeline_rank, mine.data_rank, mine.tensor_rank) == \
            (coord.pipe, coord.data, coord.model)


def test_a_layer_built_alone_has_the_weights_it_has_in_the_whole_model():
    """Per-layer init streams: a block (and a bias table) built on its own, as a pipeline stage
    builds it, equals the one inside the single-process model; the default generator is left as
    it was."""
    from megatron.model.t5 import T5Model
    from megatron.model.transformer import InitMethods, T5Block, relative_attention_bias
    from megatron.tensor_parallel.group import SINGLE
    from megatron.tensor_parallel.random import init_rng

    c = config(num_layers=3, num_decoder_layers=2)
    torch.manual_seed(11)
    model = T5Model(c)
    after = torch.rand(3)
    torch.manual_seed(11)
    assert torch.equal(torch.rand(3), after)  # building the model drew nothing from it
    torch.manual_seed(11)
    with init_rng("decoder.block.1"):
        block = T5Block(c, InitMethods(c, 2), True, has_relative_attention_bias=False,
                        tp=SINGLE)
    table = relative_attention_bias(c, InitMethods(c, 3), False, SINGLE)
    want = model.decoder.block[1].state_dict()
    assert want.keys() == block.state_dict().keys()
    assert all(torch.equal(v, want[k]) for k, v in block.state_dict().items())
    assert torch.equal(table.weight,
                       model.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight)
    torch.manual_seed(12)
    other = T5Model(c)
    assert not torch.equal(other.shared.weight, model.shared.weight)  # --seed still matters
