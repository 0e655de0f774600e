"""The llama.cpp build's AMX decision and the check bench makes: the probe's child process reports a SIGILL instead
of dying with it, a compiler whose native target has AMX gets it compiled out where the probe fails, and a build
made for another CPU, another version or before build infos is refused with a line that says `make engines`."""

import shutil
import subprocess

import pytest

from specdraft.bench.llamacpp_build import (
    BUILD_INFO,
    FORMAT,
    LLAMA_CPP_PYTHON_VERSION,
    NO_AMX_FLAGS,
    PROBE,
    USABLE,
    build_problem,
    build_summary,
    check_build,
    compile_probe,
    decide_amx,
    engines_bin_dir,
    machine,
    read_build_info,
    run_probe,
    write_build_info,
)
from specdraft.errors import SpecdraftError

CC = shutil.which("cc") or shutil.which("gcc")


def _info(**changes) -> dict:
    info = {"format": FORMAT, "llama_cpp_python": LLAMA_CPP_PYTHON_VERSION, "commit": "0c1e57098",
            "cmake_options": ["-DGGML_NATIVE=ON"], "machine": machine(),
            "amx": {"native": [], "probe": "not run", "enabled": False, "c_flags": [], "compiled": []}}
    return info | changes


def _script(path, body: str):
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


def _sapphire_rapids_cc(tmp_path):
    """A compiler whose -march=native is a CPU with AMX (on any x86 machine this GCC can target)."""
    if CC is None or subprocess.run([CC, "-march=sapphirerapids", "-E", "-x", "c", "/dev/null"],
                                    capture_output=True).returncode != 0:
        pytest.skip("no C compiler that knows -march=sapphirerapids")
    return str(_script(tmp_path / "cc", f'exec {CC} "$@" -march=sapphirerapids'))


def test_the_probe_reports_sigill_from_its_child_process(tmp_path):
    assert run_probe(_script(tmp_path / "ill", "kill -ILL $$")).startswith("SIGILL")
    assert "refused" in run_probe(_script(tmp_path / "no", "exit 3"))
    assert run_probe(_script(tmp_path / "ok", "exit 0")) == USABLE
    assert "did not run" in run_probe(tmp_path / "missing")


def test_the_real_probe_without_permission_dies_with_sigill_in_its_child(tmp_path):
    """Without arch_prctl, tile instructions raise SIGILL on every x86 CPU: on one without AMX (#UD) and on one with
    it (the kernel refuses the first use). The probe must report it, not crash this process."""
    if CC is None or compile_probe(CC, tmp_path / PROBE) is not None:
        pytest.skip("no C compiler with AMX intrinsics")
    assert run_probe(tmp_path / PROBE, request=False).startswith("SIGILL")


def test_amx_is_compiled_out_where_the_probe_fails(tmp_path):
    amx = decide_amx(_sapphire_rapids_cc(tmp_path), tmp_path / PROBE)
    assert amx["native"] == ["__AMX_BF16__", "__AMX_INT8__", "__AMX_TILE__"]
    assert amx["enabled"] == (amx["probe"] == USABLE)
    if not amx["enabled"]:  # every machine without usable AMX, this one included
        assert amx["c_flags"] == list(NO_AMX_FLAGS) and amx["compiled"] == []


def test_a_native_target_without_amx_needs_no_probe(tmp_path):
    if CC is None:
        pytest.skip("no C compiler")
    cc = str(_script(tmp_path / "cc", f'exec {CC} "$@" -march=x86-64-v3'))  # AVX2, no AMX
    amx = decide_amx(cc, tmp_path / PROBE)
    assert amx == {"native": [], "probe": "not run: -march=native has no AMX here", "enabled": False,
                   "c_flags": [], "compiled": []}


def test_a_build_fits_only_the_machine_and_version_it_was_made_for():
    here = machine()
    assert build_problem(_info(), here) is None
    assert "no build info" in build_problem(None, here)
    assert "0.3.1" in build_problem(_info(llama_cpp_python="0.3.1"), here)
    assert "Xeon" in build_problem(_info(machine={"cpu": "Intel Xeon", "flags": here["flags"]}), here)
    changed = build_problem(_info(machine={"cpu": here["cpu"], "flags": [*here["flags"], "amx_tile"]}), here)
    assert "-amx_tile" in changed


def test_bench_refuses_a_stale_or_mismatched_build(tmp_path, monkeypatch):
    folder = tmp_path / "bin"
    folder.mkdir()
    assert check_build(folder) is None  # somebody's own build, without specdraft's build info: not judged
    write_build_info(folder, _info())
    assert check_build(folder) == read_build_info(folder)
    write_build_info(folder, _info(machine={"cpu": "Intel Xeon Platinum", "flags": machine()["flags"]}))
    with pytest.raises(SpecdraftError, match=r"Xeon Platinum.*rerun `make engines`$"):
        check_build(folder)
    write_build_info(folder, _info(amx={"enabled": True, "probe": USABLE, "c_flags": []}))
    _script(folder / PROBE, "kill -ILL $$")  # AMX was usable at build time, no longer is
    with pytest.raises(SpecdraftError, match=r"uses AMX and SIGILL.*make engines"):
        check_build(folder)
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    engines = engines_bin_dir()
    engines.mkdir(parents=True)
    _script(engines / "llama-server", "exit 0")
    with pytest.raises(SpecdraftError, match=r"no build info.*make engines"):  # an engines build of before
        check_build(engines)


def test_the_summary_names_the_build():
    summary = build_summary(_info(amx={"enabled": False, "probe": "SIGILL: ...", "c_flags": list(NO_AMX_FLAGS)}))
    assert summary["checked"] and summary["commit"] == "0c1e57098" and summary["repack"] is True
    assert summary["amx"] is False and summary["c_flags"] == list(NO_AMX_FLAGS)
    assert build_summary(None) == {"checked": False, "repack": True,
                                   "note": "a llama.cpp build without specdraft build info"}
    assert BUILD_INFO.endswith(".json")
