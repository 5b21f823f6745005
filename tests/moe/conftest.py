"""The flag tests take the training tests' small command line (tests/training/train_workers.py)
and the process harness's free port (tests/distributed/harness.py); the parity and conversion
tests share tests/moe/moe_batches.py."""

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
for folder in ("training", "distributed", "moe"):
    if str(TESTS / folder) not in sys.path:
        sys.path.insert(0, str(TESTS / folder))
