"""The small batch the MoE parity and conversion tests feed both models (vocabulary 300)."""

import torch

VOCAB = 300


def batch(seed=0):
    """(encoder ids [3, 12], decoder ids [3, 7], labels [3, 7]), no padding."""
    g = torch.Generator().manual_seed(seed)
    enc = torch.randint(2, VOCAB, (3, 12), generator=g)
    dec = torch.randint(2, VOCAB, (3, 7), generator=g)
    labels = torch.randint(2, VOCAB, (3, 7), generator=g)
    return enc, dec, labels
