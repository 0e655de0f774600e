import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests/toys.py
torch.set_num_threads(1)  # tiny models: threads only add overhead, and CI has 2 cores


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
