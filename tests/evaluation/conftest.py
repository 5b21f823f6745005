"""The evaluation tests import the process harness from tests/distributed and the tiny models
of tests/generation."""

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "distributed"))
sys.path.insert(0, str(HERE.parent / "generation"))
sys.path.insert(0, str(HERE.parent / "training"))
sys.path.insert(0, str(HERE))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
