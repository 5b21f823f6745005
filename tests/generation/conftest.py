"""The generation tests import the process harness from tests/distributed and the pretraining
workers from tests/training (a tiny checkpoint to decode with)."""

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "distributed"))
sys.path.insert(0, str(HERE.parent / "training"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
