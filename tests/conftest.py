import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests/toys.py
torch.set_num_threads(1)  # tiny models: threads only add overhead, and CI has 2 cores


@pytest.fixture(autouse=True, scope="session")
def _cost_curves_in_a_temporary_folder(tmp_path_factory):
    """Cost curves measured for toy models stay out of the user's cache."""
    patch = pytest.MonkeyPatch()
    patch.setenv("SPECDRAFT_COSTS_DIR", str(tmp_path_factory.mktemp("costs")))
    yield
    patch.undo()


@pytest.fixture(autouse=True)
def _auto_device_is_the_cpu(monkeypatch):
    """``device="auto"`` means the CPU in tests, whatever the machine has, so that no test depends on which device
    exists; a test of the CUDA paths asks for ``cuda`` by name (and is skipped without one). Processes a test starts
    (torchrun, spawn) pass ``--device cpu`` / ``device="cpu"`` themselves."""
    from specdraft import hardware

    monkeypatch.setattr(hardware, "auto_is_cuda", lambda: False)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
