"""CPM-2 command lines run as they are: `python -m torch.distributed.launch ... pretrain_enc_dec.py
--model-config ... --deepspeed --deepspeed_config ...` is `megatron.pretrain_t5`."""

import sys

from megatron.pretrain_t5 import main

if __name__ == "__main__":
    sys.exit(main())
