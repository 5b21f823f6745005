"""The memory estimate: parameter counts against the model, ZeRO's accounting by hand, and the
activation formula against the bytes autograd really saves."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.model import T5Config, T5Model
from megatron.model.config import ConfigError
from megatron.model.meta import count_parameters, num_parameters, parameter_numels
from megatron.tensor_parallel.random import model_parallel_seed
from memory_layouts import estimate

SMALL = dict(vocab_size=1000, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4)
BATCH, ENC_LEN, DEC_LEN = 2, 64, 16


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matrices: a second thread only adds contention (10x slower on a busy 2-core box)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# Parameters ---------------------------------------------------------------------------------
@pytest.mark.parametrize("fields", [
    dict(SMALL, feed_forward_proj="relu"),
    dict(SMALL, feed_forward_proj="gated-gelu", tie_word_embeddings=False, num_decoder_layers=3),
])
def test_parameter_numels_match_a_meta_model(fields):
    config = T5Config(**fields)
    model = T5Model(config, make_vocab_size_divisible_by=128, device="meta")
    expected = {name: p.numel() for name, p in model.named_parameters()}
    assert parameter_numels(config, 1, 128) == expected
    assert count_parameters(config, 1, 128) == sum(expected.values())
    assert count_parameters(config, 1, 1) == num_parameters(config, 1)


def test_tensor_parallel_parameter_count_by_hand():
    config = T5Config(**SMALL, feed_forward_proj="gated-gelu", tie_word_embeddings=False)
    d, inner, ff, tp = 64, 64 // 2, 128 // 2, 2
    vocab = 1024 // tp  # 1000 padded to a multiple of 128 x 2
    attention, dense, norm = 4 * d * inner, 3 * d * ff, d
    encoder = 2 * (attention + dense + 2 * norm) + 32 * 2 + norm
    decoder = 2 * (2 * attention + dense + 3 * norm) + 32 * 2 + norm
    assert count_parameters(config, tp, 128) == 2 * vocab * d + encoder + decoder
    with pytest.raises(ConfigError, match="num_heads"):
        count_parameters(config, 3)


# Model states -------------------------------------------------------------------------------
STATES_CONFIG = T5Config(vocab_size=1000, d_model=1000, d_kv=1, d_ff=4, num_layers=1,
                         num_heads=4)
NO_BUFFERS = dict(reduce_bucket_size=1, stage3_max_live_parameters=0,
                  stage3_param_persistence_threshold=0)  # DeepSpeed's zero_optimization


def states(**kwargs):
    """An estimate dominated by one 1000 x 1000 embedding, and its parameter count."""
    return estimate(STATES_CONFIG, make_vocab_size_divisible_by=1000, **kwargs), \
        count_parameters(STATES_CONFIG, 1, 1000)


@pytest.mark.parametrize("stage,per_param", [
    (0, (2, 2, 12)), (1, (2, 2, 12 / 4)), (2, (2, 2 / 4, 12 / 4)), (3, (2 / 4, 2 / 4, 12 / 4))])
def test_zero_stages_bf16_by_hand(stage, per_param):
    est, psi = states(zero_stage=stage, data_parallel_size=4, precision="bf16",
                      zero_optimization=NO_BUFFERS)
    got = (est.parameters, est.gradients, est.optimizer_states)
    assert got == pytest.approx([x * psi for x in per_param], abs=12)  # ceil(psi / 4)
    step = 4 * (psi if stage == 0 else math.ceil(psi / 4))  # fp32 gradients at the step
    assert est.total == sum(got) + est.buffers + max(est.activations, step)


def test_fp32_master_weights_only_where_deepspeed_clones_them():
    for stage, master in ((0, 0), (1, 4), (2, 4), (3, 0)):
        est, psi = states(zero_stage=stage, precision="fp32", zero_optimization=NO_BUFFERS)
        assert est.optimizer_states == (8 + master) * psi
        assert est.parameters == est.gradients == 4 * psi


def test_buckets_are_deepspeeds_transient_buffers():
    buckets = {"reduce_bucket_size": 1000, "overlap_comm": True,
               "stage3_max_live_parameters": 5000}
    assert states(zero_stage=2, zero_optimization=buckets)[0].buffers == 2 * 2 * 1000
    assert states(zero_stage=3, zero_optimization=buckets)[0].buffers == 2 * 1000 + 2 * 5000
    est, psi = states(zero_stage=0, data_parallel_size=2)
    assert est.buffers == 2 * psi  # the flattened all-reduce bucket, at most the model


def test_offload_moves_optimizer_states_and_gradient_partition_off_the_device():
    on, psi = states(zero_stage=2, data_parallel_size=2, zero_optimization=NO_BUFFERS)
    off, _ = states(zero_stage=2, data_parallel_size=2, offload_optimizer="cpu",
                    zero_optimization=NO_BUFFERS)
    shard = math.ceil(psi / 2)
    assert off.optimizer_states == 0 and off.gradients == 0
    assert off.offloaded == 12 * shard + 4 * shard  # master + moments, fp32 gradient partition
    # the step's fp32 copy of the gradient partition is made on the host too
    assert off.total == on.total - on.optimizer_states - on.gradients \
        - max(on.activations, 4 * shard) + off.activations
    both, _ = states(zero_stage=3, data_parallel_size=2, offload_optimizer="nvme",
                     offload_param="nvme", zero_optimization=dict(stage3_max_live_parameters=0,
                                                                  reduce_bucket_size=1))
    small = [n for n in parameter_numels(STATES_CONFIG, 1, 1000).values() if n <= 100_000]
    assert both.parameters == 2 * sum(small)  # below the persistence threshold: kept whole
    assert both.optimizer_states == both.gradients == 0
    assert both.offloaded == 12 * shard + 2 * shard + 2 * math.ceil((psi - sum(small)) / 2)


def test_tensor_parallelism_divides_the_sharded_parts():
    config = T5Config(**SMALL)
    one = estimate(config, tensor_parallel_size=1, zero_stage=0, precision="bf16")
    two = estimate(config, tensor_parallel_size=2, zero_stage=0, precision="bf16")
    psi1, psi2 = count_parameters(config, 1), count_parameters(config, 2)
    norms = 10 * 64 + 2 * 64  # layer norms stay whole on every rank
    assert psi2 == (psi1 - norms) // 2 + norms
    assert two.parameters == 2 * psi2 and two.optimizer_states == 12 * psi2
    assert two.activations < one.activations


def test_fused_attention_keeps_less_than_eager_and_the_table_prints():
    config = T5Config(**SMALL)
    kw = dict(micro_batch_size=8, encoder_seq_length=512, decoder_seq_length=128)
    fused = estimate(config, attention_kernel="fused", **kw)
    eager = estimate(config, attention_kernel="eager", **kw)
    assert fused.activations < eager.activations
    lines = fused.table()
    assert len(lines) == 8 and lines[6].startswith("total on device")


def test_errors_name_the_argument():
    config = T5Config(**SMALL)
    with pytest.raises(ValueError, match="offload_param needs ZeRO stage 3"):
        estimate(config, zero_stage=2, offload_param="cpu")
    with pytest.raises(ValueError, match="precision"):
        estimate(config, precision="fp8")
    with pytest.raises(ValueError, match="micro_batch_size"):
        estimate(config, micro_batch_size=0)


# Activations --------------------------------------------------------------------------------
def measure(config, checkpoint, chunk, dtype=torch.float32):
    """Bytes autograd saves in a training forward (each storage once, parameters excluded), and
    the other terms of the peak: logits held by the output, what their gradient adds (its
    storage and, when it is a cast, the cast's source, each unless saved already), the largest
    chunk recomputed in backward and what the head had saved (freed before any recompute)."""
    model_parallel_seed(0)
    model = T5Model(config, attention_backend="eager", checkpoint_activations=checkpoint,
                    checkpoint_num_layers=chunk, dtype=dtype).train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    phase, steady, head, chunks = ["forward"], {}, {}, []

    def pack(tensor):
        # Holding the storages keeps their addresses from being reused while we count.
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in params and ptr not in steady:
            if phase[0] == "head":
                head[ptr] = storage
            target = chunks[-1] if phase[0] == "backward" else steady
            target[ptr] = storage
        return tensor

    for stack in (model.encoder, model.decoder):
        for i, block in enumerate(stack.block):
            if i % chunk == 0:
                block.register_forward_pre_hook(
                    lambda *_: chunks.append({}) if phase[0] == "backward" else None)
    lm_logits = model.lm_logits

    def head_from_here(hidden):
        phase[0] = "head"
        return lm_logits(hidden)

    model.lm_logits = head_from_here
    # A 16-bit logits' gradient is a cast of an fp32 one that the gradient hook never sees:
    # record each cast's output (address, dtype, shape) -> its source (address, bytes).
    casts = {}

    class Casts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._to_copy.default:
                source = args[0].untyped_storage()
                casts[out.untyped_storage().data_ptr(), out.dtype, out.shape] = \
                    (source.data_ptr(), source.nbytes())
            return out

    def new_bytes(ptr, nbytes):
        return 0 if ptr in steady else nbytes

    def on_logits_grad(grad):
        storage = grad.untyped_storage()
        source = casts.get((storage.data_ptr(), grad.dtype, grad.shape), (None, 0))
        grads.append(new_bytes(storage.data_ptr(), storage.nbytes()) + new_bytes(*source))

    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(2, config.vocab_size, (BATCH, n), generator=g)
           for n in (ENC_LEN, DEC_LEN, DEC_LEN)]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(ids[0], ids[1], labels=ids[2])
        grads = []
        out.logits.register_hook(on_logits_grad)
        phase[0] = "backward"
        with Casts():
            out.loss.backward()
    size = lambda storages: sum(s.nbytes() for s in storages.values())  # noqa: E731
    return dict(saved=size(steady), logits=out.logits.untyped_storage().nbytes(),
                logits_grad=grads[0], head=size(head),
                recompute=max((size(c) for c in chunks), default=0))


CASES = [(ff, p, ckpt, chunk, "fp32", 1000) for ff in ("relu", "gated-gelu") for p in (0.0, 0.1)
         for ckpt, chunk in ((False, 1), (True, 1))] + [
    ("gated-gelu", 0.1, True, 2, "fp32", 1000), ("gated-gelu", 0.1, False, 1, "bf16", 1000),
    ("relu", 0.0, True, 1, "bf16", 1000),
    # a vocabulary with no padding (T5's 32128 = 251 x 128): the loss's buffer is the gradient
    ("relu", 0.0, False, 1, "fp32", 1024), ("relu", 0.0, False, 1, "bf16", 1024)]


@pytest.mark.parametrize("ff,dropout,checkpoint,chunk,precision,vocab", CASES)
def test_activations_match_the_saved_tensors(ff, dropout, checkpoint, chunk, precision, vocab):
    """To the byte: what forward saves, and the peak (the cases cover both of its branches,
    the logits' gradient and a recomputed chunk)."""
    config = T5Config(**dict(SMALL, vocab_size=vocab), feed_forward_proj=ff,
                      dropout_rate=dropout)
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    m = measure(config, checkpoint, chunk, dtype)
    est = estimate(config, precision=precision, micro_batch_size=BATCH,
                          encoder_seq_length=ENC_LEN, decoder_seq_length=DEC_LEN,
                          checkpoint_activations=checkpoint, checkpoint_num_layers=chunk,
                          attention_kernel="eager")
    peak = m["saved"] + m["logits"] + max(m["logits_grad"], m["recompute"] - m["head"])
    assert est.activations_saved == m["saved"]
    assert est.activations == peak
