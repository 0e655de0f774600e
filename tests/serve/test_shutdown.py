"""Starting and stopping the server: settings refused before any model loads (one `specdraft: error:` line, exit
2), and a graceful shutdown that ends every request in flight cleanly (streams with an error event and
``[DONE]``, other requests with a JSON body), refuses new ones with 503 and exits within the grace period."""

import json
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
from running import RunningServer, free_port, start_cli_server

from specdraft.api import load_target
from specdraft.batching import MAX_TREE_NODES
from specdraft.cli import main
from specdraft.sequence import MAX_NUM_DRAFT_TOKENS
from specdraft.serve import ServeConfig
from specdraft.serve.app import build_app
from specdraft.serve.engine import Engine

NO_EOS_PROMPT = [1, 9, 12, 40]  # the tiny target (seed 0) answers it greedily with one token repeated, never eos


def _serve_error(capsys, *args: str) -> str:
    assert main(["serve", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("specdraft: error: ") and "Traceback" not in err
    return err


def test_server_settings_are_refused_before_any_model_loads(capsys, tmp_path):
    missing = str(tmp_path / "no-such-model")  # loading it would fail: each error must come before
    gamma = _serve_error(capsys, "--target", missing, "--num-draft-tokens", "10000")
    assert f"num_draft_tokens must be at most {MAX_NUM_DRAFT_TOKENS}" in gamma
    nodes = _serve_error(capsys, "--target", missing, "--drafter", "rest", "--drafter-option", "tree_nodes=500")
    assert f"tree_nodes must be in 0 .. {MAX_TREE_NODES}" in nodes
    assert "shutdown_grace" in _serve_error(capsys, "--target", missing, "--shutdown-grace", "-1")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        assert f"cannot listen on 127.0.0.1:{port}" in _serve_error(capsys, "--target", missing, "--port", port)


def test_a_damaged_online_distill_folder_is_one_line_naming_the_file(capsys, tmp_path):
    from safetensors.torch import save_file
    from torch import zeros

    folder = tmp_path / "osd"
    folder.mkdir()
    weights = folder / "drafter-v1.safetensors"
    save_file({"w": zeros(64, 64)}, weights)
    weights.write_bytes(weights.read_bytes()[:5000])  # truncated, as by a full disk
    (folder / "state.json").write_text(json.dumps({"base": "d", "version": 1, "weights": weights.name}))
    (folder / ".state.json.123.tmp").write_text("{")
    args = ["--target", str(tmp_path / "t"), "--draft", "d", "--port", str(free_port()), "--online-distill"]
    err = _serve_error(capsys, *args, str(folder))
    assert str(weights) in err and "damaged" in err
    (folder / "state.json").write_text("{not json")
    assert "state.json is unreadable or not valid JSON" in _serve_error(capsys, *args, str(folder))
    (folder / "state.json").unlink()
    assert "is not a folder" in _serve_error(capsys, *args, str(weights))


def _sse(response: httpx.Response) -> list[str]:
    return [line[6:] for line in response.iter_lines() if line.startswith("data: ")]


def _in_flight(url: str, stream: bool, max_tokens: int = 180):
    """A long completion (never ends by itself within the test); its stream's events, or the response."""
    body = {"model": "tiny", "prompt": NO_EOS_PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if not stream:
        return httpx.post(url + "/v1/completions", json=body, timeout=120)
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
        return _sse(response)


def _assert_ended_cleanly(results: list, status: int = 503) -> None:
    for result in results:
        if isinstance(result, list):  # a stream: tokens, then an error event, then [DONE]
            assert result[-1] == "[DONE]", result[-3:]
            error = json.loads(result[-2])["error"]
            assert error["type"] == "service_unavailable" and "shutting down" in error["message"]
            assert len(result) > 2  # it had streamed tokens before
        else:
            assert result.status_code == status and result.json()["error"]["type"] == "service_unavailable"


def _wait_running(url: str, count: int) -> None:
    deadline = time.monotonic() + 120
    while httpx.get(url + "/health", timeout=10).json()["running"] < count:
        assert time.monotonic() < deadline, "the requests did not all start"
        time.sleep(0.05)


class _SlowDrafter:
    """Proposes nothing, slowly: keeps every sequence in flight for the whole test."""

    name, vocab_size, max_context = "slow", None, None

    def begin(self, target, cache) -> None:
        pass

    def propose(self, context, num_draft_tokens, sampling, generator):
        from specdraft.drafters.base import EMPTY_DRAFT

        time.sleep(0.02)
        return EMPTY_DRAFT

    def observe(self, result) -> None:
        pass


@pytest.mark.slow  # asserts the drain's timing: run on a quiet machine (make test-slow)
def test_draining_ends_eight_requests_in_flight_cleanly(tiny_checkpoint):
    target, tokenizer = load_target(str(tiny_checkpoint))
    grace = 2.0
    serve = ServeConfig(target="tiny", max_batch=8, max_queue=8, max_prompt_tokens=16, max_tokens=180,
                        shutdown_grace=grace)
    app = build_app(Engine(target, tokenizer, _SlowDrafter, 8, 200, 8), tokenizer, serve, (2,))
    with RunningServer(app) as running, ThreadPoolExecutor(8) as pool:
        flights = [pool.submit(_in_flight, running.url, i % 2 == 0) for i in range(8)]
        _wait_running(running.url, 8)
        drain, ended = app.state.drain, threading.Event()
        started = time.monotonic()
        drain.loop.call_soon_threadsafe(drain.begin, ended.set)
        while not drain.draining:
            time.sleep(0.01)
        late = httpx.post(running.url + "/v1/completions", json={"model": "tiny", "prompt": "w1"}, timeout=10)
        health = httpx.get(running.url + "/health", timeout=10)
        results = [flight.result(60) for flight in flights]
        assert ended.wait(10)
        took = time.monotonic() - started
    assert late.status_code == 503 and late.json()["error"]["type"] == "service_unavailable"
    assert health.status_code == 503 and health.json()["status"] == "draining"
    _assert_ended_cleanly(results)
    assert grace - drain.reserve <= took < grace


@pytest.fixture(scope="module")
def long_context_checkpoint(tmp_path_factory):
    from toys import save_tiny_checkpoint

    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny4k") / "tiny", seed=0, max_positions=4096)


@pytest.mark.slow  # a process that must exit within its grace: run on a quiet machine (make test-slow)
def test_sigterm_with_eight_in_flight_ends_each_cleanly_and_exits_within_the_grace(long_context_checkpoint,
                                                                                       tmp_path):
    """The process: SIGTERM drains (new requests 503), ends every request in flight cleanly and exits within
    --shutdown-grace, leaving no process behind."""
    grace = 3.0
    process, url = start_cli_server(tmp_path / "serve.log", "--target", str(long_context_checkpoint),
                                    "--served-model-name", "tiny", "--max-tokens", "2000", "--max-prompt-tokens", "16",
                                    "--shutdown-grace", str(grace), "--max-batch", "8")
    try:
        with ThreadPoolExecutor(8) as pool:
            flights = [pool.submit(_in_flight, url, i % 2 == 0, 2000) for i in range(8)]
            _wait_running(url, 8)
            family = psutil.Process(process.pid).children(recursive=True)
            sent = time.monotonic()
            process.send_signal(signal.SIGTERM)
            time.sleep(0.2)
            late = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "w1"}, timeout=10)
            code = process.wait(30)
            took = time.monotonic() - sent
            results = [flight.result(30) for flight in flights]
    finally:
        if process.poll() is None:
            process.kill()
    assert late.status_code == 503
    _assert_ended_cleanly(results)
    log = (tmp_path / "serve.log").read_text()
    assert code in (0, -signal.SIGTERM) and "Traceback" not in log, log[-2000:]
    assert took < grace, f"exit took {took:.2f} s"
    assert not [p for p in family if p.is_running()]

