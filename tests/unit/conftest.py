"""Fixtures the unit tests share: a real TCPStore standing for torchrun's agent store (the
one-process gloo group is tests/conftest.py's)."""

from datetime import timedelta

import pytest


@pytest.fixture
def agent_store():
    """A function of a world size: (a real TCPStore standing for torchrun's agent store, the
    environment torchrun gives its ranks). The store binds a port of the kernel's choosing
    itself (no window for another process to take it); it lives until the test ends."""
    import torch.distributed as dist

    stores = []

    def make(world_size: int = 2):
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30),
                              wait_for_workers=False)
        stores.append(store)
        env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(store.port), "WORLD_SIZE": str(world_size),
               "TORCHELASTIC_RESTART_COUNT": "0"}
        return store, env

    yield make
    stores.clear()
