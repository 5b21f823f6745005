"""Megatron's script path: `torchrun ... pretrain_t5.py ...` runs `megatron.pretrain_t5`."""

import sys

from megatron.pretrain_t5 import main

if __name__ == "__main__":
    sys.exit(main())
