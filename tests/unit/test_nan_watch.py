"""NonFiniteWatch (megatron/training/nan_locator.py) on small real models: the first module in
execution order whose forward output, backward input gradient or parameter gradient is not
finite, by the model's own module names."""

import torch
from torch import nn

from megatron.training.nan_locator import ROOT, Finding, NonFiniteWatch


def chain(huge_at: int, scale: float) -> nn.Sequential:
    """Four linear layers, layer `huge_at` with every weight = scale."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(8, 8, bias=False) for _ in range(4)))
    with torch.no_grad():
        model[huge_at].weight.fill_(scale)
    return model


def run(model, x, loss_fn=lambda y: y.sum()):
    watch = NonFiniteWatch(model).attach()
    try:
        loss_fn(model(x)).backward()
        return watch.first()
    finally:
        watch.detach()


def test_all_finite():
    assert run(chain(2, 0.1), torch.randn(3, 8)) is None


def test_forward_names_the_first_overflowing_module():
    # layer 2's outputs are 3e38 x (sum of 8 inputs): inf; its own input is finite
    assert run(chain(2, 3e38), torch.randn(3, 8)) == Finding(0, "forward output", "2")


def test_forward_reported_before_the_backward_of_its_micro_batch():
    model = chain(1, 3e38)
    assert run(model, torch.randn(3, 8)).phase == "forward output"


def test_backward_names_the_module_nearest_the_loss_whose_input_gradient_overflows():
    """Layer 1 scaled by 1e-12, layer 2 by 1e30: the outputs (~1e18) and the loss (their
    squares summed, ~1e37) are finite; the loss's gradient (~1e18) is too, as far as layer 3's
    input; layer 2 multiplies it by 1e30 on the way to its input: inf (and every module before
    it gets non-finite gradients after that)."""
    model = chain(2, 1e30)
    with torch.no_grad():
        model[1].weight.mul_(1e-12)
    found = run(model, torch.randn(3, 8), loss_fn=lambda y: y.pow(2).sum())
    assert found == Finding(0, "backward input gradient", "2")


def test_the_root_module_is_named_where_only_its_own_code_overflows():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(x) * 1e38  # as T5Model's head and loss after its layers

    assert run(Scaled(), torch.full((2, 8), 1.0) * 100) == Finding(0, "forward output", ROOT)


def test_micro_batches_are_counted():
    model = chain(0, 0.1)
    watch = NonFiniteWatch(model).attach()
    for micro, x in enumerate([torch.randn(2, 8), torch.full((2, 8), float("nan"))]):
        watch.new_micro_batch(micro)
        model(x).sum().backward()
    # the first module's output is where the NaN input shows first
    assert watch.first() == Finding(1, "forward output", "0")
    watch.reset()
    assert watch.first() is None
    watch.detach()
