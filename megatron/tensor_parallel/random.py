"""Random-number streams for tensor parallelism, and activation checkpointing that replays them.

Two streams feed dropout:
- the default generator, seeded identically on every rank: dropout on replicated activations
  (hidden states between sublayers) must draw the same mask on every tensor-parallel rank;
- the tracker's 'model-parallel-rng' stream, seeded with `seed + 2718 + tensor_rank`: dropout on
  sharded activations (attention probabilities of this rank's heads, this rank's slice of the
  feed-forward) must differ across tensor-parallel ranks and match across data-parallel ranks.

The tracker is module-level like the process groups: random state is process-global anyway, and
DeepSpeed's activation checkpointing asks the `mpu` for `get_cuda_rng_tracker()`. It works on CPU
(the default CPU generator) and CUDA (the current device's generator) alike.

`checkpoint(function, *args)` runs `function` without keeping its activations and recomputes it
in backward under the random states of the forward, tracker included, so gradients with dropout
are bit-identical with and without checkpointing.
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Dict, Iterator

import torch

MODEL_PARALLEL_RNG = "model-parallel-rng"


def _device_type() -> str:
    return "cuda" if torch.cuda.is_available() and torch.cuda.is_initialized() else "cpu"


def get_device_rng_state(device_type: str) -> torch.Tensor:
    return torch.cuda.get_rng_state() if device_type == "cuda" else torch.get_rng_state()


def set_device_rng_state(state: torch.Tensor, device_type: str) -> None:
    if device_type == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named random states that can be swapped in for the default generator of one device."""

    def __init__(self) -> None:
        self.states: Dict[str, torch.Tensor] = {}
        self.device_type = "cpu"

    def reset(self, device_type: str = "cpu") -> None:
        self.states = {}
        self.device_type = device_type

    def get_states(self) -> Dict[str, torch.Tensor]:
        return {name: state.clone() for name, state in self.states.items()}

    def set_states(self, states: Dict[str, torch.Tensor]) -> None:
        self.states = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        if name in self.states:
            raise ValueError(f"random state {name!r} already exists")
        if self.device_type == "cuda":
            saved = torch.cuda.get_rng_state()
            torch.cuda.manual_seed(seed)
            self.states[name] = torch.cuda.get_rng_state()
            torch.cuda.set_rng_state(saved)
        else:
            self.states[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Draw from the named stream inside the block, then give the default generator back."""
        if name not in self.states:
            raise KeyError(f"random state {name!r} was never added: call model_parallel_seed()")
        saved = get_device_rng_state(self.device_type)
        set_device_rng_state(self.states[name], self.device_type)
        try:
            yield
        finally:
            self.states[name] = get_device_rng_state(self.device_type)
            set_device_rng_state(saved, self.device_type)


_TRACKER = RNGStatesTracker()


def get_cuda_rng_tracker() -> RNGStatesTracker:
    """The process's tracker (Megatron's and DeepSpeed's name; it serves CPU too)."""
    return _TRACKER


def model_parallel_seed(seed: int, device_type: str = "cpu", tensor_rank: int = 0) -> None:
    """Seed the default generators with `seed` and the tracker's stream per tensor rank."""
    torch.manual_seed(seed)
    _TRACKER.reset(device_type)
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + 2718 + tensor_rank)


def _rng_snapshot(device_type: str):
    cuda = torch.cuda.get_rng_state() if device_type == "cuda" else None
    return torch.get_rng_state(), cuda, _TRACKER.get_states()


def _rng_restore(snapshot, device_type: str) -> None:
    cpu, cuda, tracker = snapshot
    torch.set_rng_state(cpu)
    if device_type == "cuda":
        torch.cuda.set_rng_state(cuda)
    _TRACKER.set_states(tracker)


class _CheckpointFunction(torch.autograd.Function):
    """Run without saving activations; recompute under the forward's random states in backward.

    Arguments may be tensors, None or other plain values; outputs a tensor or a tuple of them
    (None allowed).
    """

    @staticmethod
    def forward(ctx, function, device_type, *args):
        ctx.function = function
        ctx.device_type = device_type
        ctx.rng = _rng_snapshot(device_type)
        with torch.no_grad():
            outputs = function(*args)
        tensors = [a for a in args if torch.is_tensor(a)]
        ctx.slots = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.others = [None if torch.is_tensor(a) else a for a in args]
        ctx.save_for_backward(*tensors)
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        args = list(ctx.others)
        for slot, saved in zip(ctx.slots, ctx.saved_tensors):
            args[slot] = saved.detach().requires_grad_(saved.requires_grad)
        global _RECOMPUTING
        current = _rng_snapshot(ctx.device_type)
        _rng_restore(ctx.rng, ctx.device_type)
        _RECOMPUTING += 1
        try:
            with torch.enable_grad():
                outputs = ctx.function(*args)
        finally:
            _RECOMPUTING -= 1
            _rng_restore(current, ctx.device_type)
        if torch.is_tensor(outputs):
            outputs = (outputs,)
        pairs = [(out, grad) for out, grad in zip(outputs, grads)
                 if torch.is_tensor(out) and out.requires_grad and grad is not None]
        if pairs:
            torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs])
        return (None, None) + tuple(a.grad if torch.is_tensor(a) else None for a in args)


_RECOMPUTING = 0


def is_recomputing() -> bool:
    """Whether a checkpointed forward is being run again in backward (layers that count what
    they see count it once)."""
    return _RECOMPUTING > 0


def checkpoint(function, *args):
    """`function(*args)` with its activations recomputed in backward (see the module docstring)."""
    return _CheckpointFunction.apply(function, _device_type_of(args), *args)


def _device_type_of(args) -> str:
    for arg in args:
        if torch.is_tensor(arg):
            return arg.device.type
    return _device_type()


def layer_seed(base: int, name: str) -> int:
    """The seed of layer `name`'s initial weights under the run's seed `base`."""
    digest = hashlib.sha256(f"{base}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2 ** 63 - 1)


@contextlib.contextmanager
def init_rng(name: str) -> Iterator[None]:
    """Draw the initial weights of layer `name` from a stream of their own: seeded from the
    default generator's seed (`torch.manual_seed`, i.e. the run's --seed) and the name, and
    leaving the default generator as it was. So a layer's weights do not depend on which other
    layers a process builds: every pipeline stage, tensor rank and the single-process model get
    the same full weights. Initial draws happen on the CPU (tensor_parallel.layers draws a full
    CPU master tensor), so only the CPU generator is forked."""
    global _INIT_BASE
    outer = _INIT_BASE
    base = torch.initial_seed() if outer is None else outer  # nested: the run's seed still
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(layer_seed(base, name))
        _INIT_BASE = base
        try:
            yield
        finally:
            _INIT_BASE = outer


_INIT_BASE = None
