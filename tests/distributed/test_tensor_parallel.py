"""Tensor parallelism on real gloo process groups against single-process references.

Each parallel layer is checked alone against unsharded math; the whole model at TP=2 and TP=4
against TP=1 with the same full weights (logits, loss and every gradient); dropout streams per
tensor and data-parallel rank; DeepSpeed's gradient norm with our parallel_state as its mpu.
"""

import math

import pytest
import torch

from megatron import parallel_state
from megatron.model import T5Config, T5Model
from megatron.model.state_dict import gather_full_state_dict

from harness import run_workers
import workers

pytestmark = pytest.mark.slow

FIELDS = dict(vocab_size=300, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=3,
              num_heads=4, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
              dropout_rate=0.0)


def assert_close(actual, expected, rtol, msg=None):
    """Within `rtol` of each value, with a floor of `rtol` times the tensor's largest value for
    elements near zero: their float32 rounding error scales with the tensor's magnitude, not with
    their own."""
    torch.testing.assert_close(actual, expected, rtol=rtol,
                               atol=rtol * expected.abs().max().item(), msg=msg)


def test_layout_arithmetic():
    layout = parallel_state.make_layout(world_size=16, rank=13, tensor_size=2, pipeline_size=2)
    assert layout.data_size == 4
    assert (layout.tensor_rank, layout.data_rank, layout.pipeline_rank) == (1, 2, 1)
    assert layout.tensor_group_ranks()[0] == [0, 1]
    assert layout.data_group_ranks()[0] == [0, 2, 4, 6]
    assert layout.pipeline_group_ranks()[0] == [0, 8]
    assert layout.model_group_ranks()[0] == [0, 1, 8, 9]
    with pytest.raises(ValueError, match="world size 6 is not divisible"):
        parallel_state.make_layout(6, 0, 4, 1)


def test_groups_on_real_processes():
    got = run_workers(8, workers.group_membership, 2, 2)  # TP 2 x DP 2 x PP 2
    assert got[5]["tensor_model"] == [4, 5]
    assert got[5]["data"] == [5, 7]
    assert got[5]["pipeline_model"] == [1, 5]
    assert got[5]["model"] == [0, 1, 4, 5]
    assert got[5]["ranks"] == dict(tensor=1, data=0, pipeline=1, model=3, tensor_src=4,
                                   data_src=5, first=False, last=True, next=1, prev=1)
    assert got[0]["ranks"]["first"] and not got[0]["ranks"]["last"]
    for rank, seen in enumerate(got):
        assert rank in seen["tensor_model"] and rank in seen["data"]


def test_each_layer_against_unsharded_math():
    g = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    vocab, padded = 10, 12  # 2 padded columns, split over 2 ranks
    inputs = dict(x=r(3, 5, 8), w_col=r(6, 8), b_col=r(6), dy_col=r(3, 5, 6), h=r(3, 5, 6),
                  w_row=r(8, 6), b_row=r(8), dy_row=r(3, 5, 8), table=r(12, 4),
                  ids=torch.randint(0, 12, (3, 5), generator=g), dy_emb=r(3, 5, 4),
                  logits=r(3, 5, padded), target=torch.randint(0, vocab, (3, 5), generator=g),
                  vocab=vocab, dloss=r(3, 5))
    inputs["target"][0, 1] = -100
    got = run_workers(2, workers.layers, inputs)

    def reference(fn, *tensors):
        leaves = [t.clone().requires_grad_() for t in tensors]
        return fn(*leaves), leaves

    for rank_out in got:
        for gather in (True, False):
            (y, (x, w, b)) = reference(lambda x, w, b: torch.nn.functional.linear(x, w, b),
                                       inputs["x"], inputs["w_col"], inputs["b_col"])
            (y * inputs["dy_col"]).sum().backward()
            for mine, ref in zip(rank_out[f"col{gather}"], (y, x.grad, w.grad, b.grad)):
                assert_close(mine, ref.detach(), rtol=1e-6)
        for parallel_input in (True, False):
            (y, (h, w, b)) = reference(lambda h, w, b: torch.nn.functional.linear(h, w, b),
                                       inputs["h"], inputs["w_row"], inputs["b_row"])
            (y * inputs["dy_row"]).sum().backward()
            mine = rank_out[f"row{parallel_input}"]
            assert_close(mine[0], y.detach(), rtol=1e-6)
            if not parallel_input:  # a parallel input's gradient is only this rank's slice
                assert_close(mine[1], h.grad, rtol=1e-6)
            assert_close(mine[2], w.grad, rtol=1e-6)
            assert_close(mine[3], b.grad, rtol=1e-6)
        (y, (t,)) = reference(lambda t: torch.nn.functional.embedding(inputs["ids"], t),
                              inputs["table"])
        (y * inputs["dy_emb"]).sum().backward()
        assert_close(rank_out["embedding"][0], y.detach(), rtol=1e-6)
        assert_close(rank_out["embedding"][1], t.grad, rtol=1e-6)
        for smoothing in (0.0, 0.1):
            (loss, (lg,)) = reference(
                lambda lg: torch.nn.functional.cross_entropy(
                    lg[..., :vocab].reshape(-1, vocab), inputs["target"].reshape(-1),
                    reduction="none", label_smoothing=smoothing).view(3, 5),
                inputs["logits"])
            (loss * inputs["dloss"]).sum().backward()
            mine_loss, mine_grad = rank_out[f"xent{smoothing}"]
            assert_close(mine_loss, loss.detach(), rtol=1e-6)
            assert_close(mine_grad, lg.grad, rtol=1e-6)


def _batch():
    g = torch.Generator().manual_seed(5)
    enc = torch.randint(2, 300, (3, 12), generator=g)
    dec = torch.randint(2, 300, (3, 7), generator=g)
    labels = torch.randint(2, 300, (3, 7), generator=g)
    enc_mask = torch.ones(3, 12, dtype=torch.long)
    enc_mask[1, 7:] = 0
    dec_mask = torch.ones(3, 7, dtype=torch.long)
    dec_mask[2, 4:] = 0
    labels[2, 4:] = -100
    return enc, dec, enc_mask, dec_mask, labels


def _reference(fields, checkpoint=False):
    torch.manual_seed(11)
    model = T5Model(T5Config(**fields), make_vocab_size_divisible_by=1,
                    checkpoint_activations=checkpoint).eval()
    full = gather_full_state_dict(model)
    out = model(*_batch())
    out.loss.backward()
    return full, out.loss.detach(), out.logits.detach(), gather_full_state_dict(model, True)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("tied", [False, True])
def test_model_equals_single_process(tp, tied):
    fields = dict(FIELDS, tie_word_embeddings=tied,
                  feed_forward_proj="relu" if tied else "gated-gelu")
    full, loss, logits, grads = _reference(fields)
    # checkpointing on the TP side too: recomputation must not change anything
    got = run_workers(tp, workers.model_step, fields, full, _batch(),
                      dict(checkpoint=tied, deepspeed_norm=(tp == 2)))
    tp_loss, tp_logits, tp_grads = got[0]["runs"][0]
    torch.testing.assert_close(tp_loss, loss, rtol=1e-6, atol=0)
    assert_close(tp_logits, logits, rtol=1e-5)
    assert set(tp_grads) == set(grads)
    for name in grads:
        assert_close(tp_grads[name], grads[name], rtol=1e-5, msg=name)
    if tp == 2:
        # DeepSpeed counts sharded grads on every rank and replicated ones once: the flags on
        # our parameters make its norm equal the single-process norm.
        norm = torch.sqrt(sum(g.double().pow(2).sum() for g in grads.values())).item()
        for rank_out in got:
            assert abs(rank_out["deepspeed_norm"] - norm) < 1e-4 * norm


def test_dropout_is_reproducible_under_tensor_parallelism():
    fields = dict(FIELDS, dropout_rate=0.3)
    full, *_ = _reference(fields)
    got = run_workers(2, workers.model_step, fields, full, _batch(),
                      dict(train=True, repeats=2, checkpoint=False))
    (loss_a, logits_a, grads_a), (loss_b, logits_b, grads_b) = got[0]["runs"]
    assert torch.equal(loss_a, loss_b) and torch.equal(logits_a, logits_b)
    assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)
    # and checkpointing on gives the same bits under TP with dropout
    ckpt = run_workers(2, workers.model_step, fields, full, _batch(),
                       dict(train=True, checkpoint=True))
    loss_c, logits_c, grads_c = ckpt[0]["runs"][0]
    assert torch.equal(loss_a, loss_c)
    assert all(torch.equal(grads_a[n], grads_c[n]) for n in grads_a)


def test_dropout_streams_per_tensor_and_data_rank():
    got = run_workers(4, workers.dropout_streams, 2)  # TP 2 x DP 2
    by_place = {(tp, dp): (tracked, default) for tracked, default, tp, dp in got}
    # tracked (sharded activations): differs across TP ranks, equal across DP ranks
    assert not torch.equal(by_place[0, 0][0], by_place[1, 0][0])
    assert torch.equal(by_place[0, 0][0], by_place[0, 1][0])
    assert torch.equal(by_place[1, 0][0], by_place[1, 1][0])
    # default (replicated activations): equal on every rank
    assert all(torch.equal(by_place[0, 0][1], v[1]) for v in by_place.values())


@pytest.mark.parametrize("tp", [1, 2])
def test_zero_init_builds_the_same_weights(tp):
    """Each module initializes its own weights, so DeepSpeed's zero.Init (which partitions a
    module's parameters right after its constructor) keeps them; with TP the partition group must
    be the data-parallel group, or DeepSpeed broadcasts rank 0's shard over the tensor ranks."""
    got = run_workers(2, workers.zero_init_weights, tp, FIELDS)
    for diffs, partitioned in got:
        assert diffs and max(diffs.values()) == 0.0
        assert partitioned is (True if tp == 1 else None)


@pytest.mark.parametrize("tp, world", [(2, 2), (4, 4), (2, 4)], ids=["tp2", "tp4", "tp2-dp2"])
def test_the_meta_model_of_a_layout_is_every_rank_s_real_model(tp, world):
    """model/meta.py builds any rank's model of any layout in this process, without process
    groups: its parameters' names, shapes and counts are those each real rank builds."""
    from megatron.model.meta import count_parameters, meta_model, parameter_numels

    fields = dict(FIELDS, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                  num_decoder_layers=3)
    got = run_workers(world, workers.built_shapes, tp, fields, 8)
    config = T5Config(**fields)
    for shapes, tensor_rank in got:
        meta = meta_model(config, 8, tp, tensor_rank)
        assert {n: tuple(p.shape) for n, p in meta.named_parameters()} == shapes
        assert list(parameter_numels(config, tp, 8).values()) == \
            [math.prod(s) for s in shapes.values()]
        assert count_parameters(config, tp, 8) == sum(math.prod(s) for s in shapes.values())
