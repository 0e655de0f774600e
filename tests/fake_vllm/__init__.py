"""A stand-in ``vllm`` package (``fake_vllm/vllm``) and the Python that runs specdraft's vLLM worker with it."""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def fake_vllm_python(folder: Path) -> Path:
    """An executable that runs this interpreter with the stand-in ``vllm`` importable (for SPECDRAFT_VLLM_PYTHON)."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "python"
    script.write_text(f'#!/bin/sh\nPYTHONPATH="{HERE}" exec "{sys.executable}" "$@"\n')
    script.chmod(0o755)
    return script
