"""The CPU eager attention kernel (megatron/model/eager_attention.py) against attention composed
from torch ops in float64: outputs and the gradients of query, key, value and bias, for the bias
shapes the model passes (a stack's [batch, heads, q, k] bias, a [1, heads, q, k] one, a padding
mask [batch, 1, 1, k] without gradient, a decoder mask [batch, 1, q, k], a padding mask where a
tensor rank holds one head, so that broadcasting it is a view), in fp32 and bf16, with
dropout drawn as megatron.model.dropout draws it; its in-place softmax and softmax backward equal
torch's bitwise; the bias it is given is left as it was."""

import pytest
import torch

from megatron.model.dropout import dropout
from megatron.model.eager_attention import eager_attention

B, H, Q, K, D = 2, 3, 7, 13, 8
BIAS_SHAPES = {"stack": (B, H, Q, K), "table": (1, H, Q, K), "padding": (B, 1, 1, K),
               "decoder": (B, 1, Q, K), "one head": (B, 1, 1, K)}


def reference(query, key, value, bias, dropout_p=0.0):
    """Composed of torch ops in float64 (dropout through megatron.model.dropout, whose draws
    depend only on the generator's state)."""
    scores = query @ key.transpose(-1, -2) + bias
    probs = torch.softmax(scores, dim=-1)
    return dropout(probs, dropout_p) @ value


def inputs(dtype, bias_name, bias_grad):
    bias_shape = BIAS_SHAPES[bias_name]
    g = torch.Generator().manual_seed(0)
    make = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    heads = 1 if bias_name == "one head" else H  # a tensor rank with one head
    tensors = [make(B, heads, Q, D), make(B, heads, K, D), make(B, heads, K, D),
               3 * make(*bias_shape)]
    if bias_shape[1] == 1:  # a mask: 0 or the dtype's minimum, some keys hidden
        tensors[3] = torch.where(tensors[3] > 2, torch.finfo(dtype).min, 0.0)
    ours = [t.to(dtype).requires_grad_(i < 3 or bias_grad) for i, t in enumerate(tensors)]
    ref = [t.detach().double().requires_grad_(t.requires_grad) for t in ours]
    return ours, ref, make(B, heads, Q, D)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias_name", list(BIAS_SHAPES))
@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_equals_composed_attention(dtype, bias_name, dropout_p):
    """fp32: within 1e-5 of the float64 reference (relative to its largest value). bf16: its
    distance from the float64 reference at most 1.5x that of the same ops composed in bf16."""
    bias_grad = bias_name in ("stack", "table")
    ours, ref, grad = inputs(dtype, bias_name, bias_grad)
    composed = [t.detach().clone().requires_grad_(t.requires_grad) for t in ours]
    bias_before = ours[3].detach().clone()
    results = []
    for fn, args, g in ((eager_attention, ours, grad.to(dtype)), (reference, ref, grad),
                        (reference, composed, grad.to(dtype))):
        torch.manual_seed(5)
        out = fn(*args, dropout_p)
        out.backward(g)
        results.append([out] + [t.grad for t in args])
    got, want, torch_ops = results

    def distance(a, b):
        return ((a.double() - b).abs().max() / b.abs().max()).item()

    for i, (a, b, c) in enumerate(zip(got, want, torch_ops)):
        if b is None:
            assert a is None, f"input {i - 1} has no gradient"
            continue
        if dtype == torch.float32:
            assert distance(a, b) <= 1e-5, (i, distance(a, b))
        else:
            assert distance(a, b) <= 1.5 * distance(c, b) + 1e-3, (i, distance(a, b),
                                                                   distance(c, b))
    assert torch.equal(ours[3].detach(), bias_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("length", [1, 13, 64, 515])
def test_in_place_softmax_and_its_backward_are_torchs(dtype, length):
    x = (torch.randn(6, 5, length, generator=torch.Generator().manual_seed(length)) * 4).to(dtype)
    expected = torch.softmax(x, dim=-1)
    buffer = x.clone()
    torch.ops.aten._softmax.out(buffer, -1, False, out=buffer)
    assert torch.equal(buffer, expected)
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    expected_grad = torch._softmax_backward_data(grad, expected, -1, dtype)
    torch.ops.aten._softmax_backward_data.out(grad, expected, -1, dtype, grad_input=grad)
    assert torch.equal(grad, expected_grad)


def test_refuses_other_devices():
    q = torch.zeros(1, 1, 2, 2, device="meta")
    with pytest.raises(ValueError, match="CPU kernel"):
        eager_attention(q, q, q, q)
