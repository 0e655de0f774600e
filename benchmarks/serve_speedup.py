"""The server's speed-up at one stream: two ``specdraft serve`` processes for the built-in target, plain and with a
draft model, asked the built-in chat prompts one at a time through HTTP (greedy), alternating which goes first;
completion tokens over the client's wall time (HTTP, prefill and the first step included), and whether the two
servers' answers are equal.

    python benchmarks/serve_speedup.py [--prompts 12] [--max-tokens 128] [--draft smollm2-135m-instruct-drafter]

The servers start and stop with the script.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import httpx

from specdraft.models.registry import SMOLLM2, SMOLLM2_DRAFTER
from specdraft.prompts import BUILTIN_PROMPTS


def _start(port: int, extra: list[str]) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "specdraft.cli", "serve", "--target", SMOLLM2, "--port", str(port), *extra]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return process, url
        except httpx.TransportError:
            time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"the server {' '.join(extra) or 'plain'} did not start")


def _ask(url: str, text: str, max_tokens: int) -> tuple[float, int, str, float | None]:
    body = {"model": SMOLLM2, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0}
    start = time.perf_counter()
    answer = httpx.post(url + "/v1/chat/completions", json=body, timeout=600).json()
    seconds = time.perf_counter() - start
    usage = answer["usage"]
    return (seconds, usage["completion_tokens"], answer["choices"][0]["message"]["content"],
            usage.get("speculation", {}).get("block_efficiency"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--draft", default=SMOLLM2_DRAFTER)
    parser.add_argument("--port", type=int, default=8131, help="the plain server's; the other takes the next")
    args = parser.parse_args()
    servers = {"plain": _start(args.port, []), "draft": _start(args.port + 1, ["--draft", args.draft])}
    try:
        for _, url in servers.values():
            _ask(url, "Hi", 8)  # warm-up
        totals = {name: [0.0, 0] for name in servers}
        same, taus = 0, []
        prompts = [p.text for p in BUILTIN_PROMPTS[: args.prompts]]
        for i, text in enumerate(prompts):
            answers = {}
            for name in (("plain", "draft") if i % 2 == 0 else ("draft", "plain")):
                seconds, tokens, answers[name], tau = _ask(servers[name][1], text, args.max_tokens)
                totals[name][0] += seconds
                totals[name][1] += tokens
                if name == "draft":
                    taus.append(tau)
            same += answers["plain"] == answers["draft"]
        rate = {name: tokens / seconds for name, (seconds, tokens) in totals.items()}
        for name, (seconds, tokens) in totals.items():
            print(f"{name}: {tokens} tokens in {seconds:.2f} s, {rate[name]:.1f} tokens/s")
        print(f"speed-up {rate['draft'] / rate['plain']:.2f}x; answers equal {same}/{len(prompts)}; "
              f"τ median {statistics.median(taus):.2f}")
    finally:
        for process, _ in servers.values():
            process.terminate()
        for process, _ in servers.values():
            process.wait(30)


if __name__ == "__main__":
    main()
