import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent))  # tests/toys.py


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    from toys import save_tiny_checkpoint

    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny", seed=0)
