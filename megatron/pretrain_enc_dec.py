"""CPM-2's entry point name: `python -m megatron.pretrain_enc_dec` is `megatron.pretrain_t5`."""

import sys

from megatron.pretrain_t5 import main

if __name__ == "__main__":
    sys.exit(main())
