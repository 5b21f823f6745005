"""The training tests import the process harness from tests/distributed; their data fixture
(`train_data`) lives in tests/conftest.py, shared with the launch tests."""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "distributed"))  # the process harness
