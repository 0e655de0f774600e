"""``tools/build_engines.py`` with a stand-in cmake: a build of before the build info is started over, the finished
build records its commit, options, AMX decision and CPU beside the programs, and a build made for this machine is
reused without running cmake again."""

import importlib.util
import json
from pathlib import Path

import pytest

from specdraft.bench.llamacpp_build import BUILD_INFO, check_build, machine

TOOL = Path(__file__).resolve().parents[2] / "tools" / "build_engines.py"
FAKE_CMAKE = """#!/bin/sh
echo "$@" >> "$CMAKE_CALLS"
if [ "$1" = "-S" ]; then mkdir -p "$4" && touch "$4/CMakeCache.txt"; exit 0; fi
mkdir -p "$2/bin"
for p in llama-server llama-speculative-simple llama-cli llama-bench llama-completion; do
    printf '#!/bin/sh\\n' > "$2/bin/$p"; chmod +x "$2/bin/$p"
done
"""


@pytest.fixture
def tool(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("build_engines", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    bin_folder = tmp_path / "fakebin"
    bin_folder.mkdir()
    (bin_folder / "cmake").write_text(FAKE_CMAKE)
    (bin_folder / "cmake").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_folder}:/usr/bin:/bin")
    monkeypatch.setenv("CMAKE_CALLS", str(tmp_path / "calls"))
    source = module.llama_cpp_source()
    source.mkdir(parents=True)
    (source.parents[1] / "CHANGELOG.md").write_text(
        f"## [Unreleased]\n\n## [{module.LLAMA_CPP_PYTHON}]\n\n- feat: update llama.cpp to ggml-org/llama.cpp@0c1e57098"
        "\n\n## [0.3.35]\n\n- feat: update llama.cpp to ggml-org/llama.cpp@4df29be4f\n")
    return module


def test_a_stale_build_is_started_over_and_a_fitting_one_reused(tool, tmp_path):
    bin_dir = tool.llama_cpp_source() / "build" / "bin"
    bin_dir.mkdir(parents=True)
    for program in tool.PROGRAMS:  # all programs there, but built before build infos existed
        (bin_dir / program).write_text("old")
        (bin_dir / program).chmod(0o755)
    assert tool.build_llama_cpp(jobs=1) == bin_dir
    assert (bin_dir / "llama-server").read_text() != "old"
    info = json.loads((bin_dir / BUILD_INFO).read_text())
    assert info["commit"] == "0c1e57098" and info["machine"] == machine() and "amx" in info
    assert "-DLLAMA_BUILD_COMMIT=0c1e57098" in info["cmake_options"] and "-DGGML_NATIVE=ON" in info["cmake_options"]
    assert check_build(bin_dir) == info
    calls = (tmp_path / "calls").read_text().splitlines()
    assert len(calls) == 2  # configure, build
    tool.build_llama_cpp(jobs=1)
    assert (tmp_path / "calls").read_text().splitlines() == calls  # reused: cmake not run again
