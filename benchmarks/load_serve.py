"""A bounded load test of ``specdraft serve`` on loopback (httpx), which starts the server, checks it, stops it.

1. Reference answers: each prompt alone through the function ``specdraft generate`` runs (batch 1, same dtype,
   drafter and γ, greedy).
2. ``--clients`` concurrent streaming chat requests (default 16), one per prompt: every streamed answer must equal
   its reference (in fp32 they are token-identical; in bf16 batched and batch-1 forwards round differently).
3. Throughput: one stream alone, then ``--concurrent`` (default 8) at once, alternately for ``--rounds`` rounds:
   completion tokens / wall time of the whole round.
4. SIGTERM; the server must exit by itself. Every wait has a timeout, so the script always ends.

    PYTHONPATH=src .venv/bin/python benchmarks/load_serve.py [--draft smollm2-135m-instruct-drafter] [--dtype float32]

Prints a summary and one JSON line; exits 1 when an answer differs or a request fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx

from specdraft.api import encode_prompt, eos_token_ids, generate, load_drafter, load_target, parse_dtype
from specdraft.models.registry import SMOLLM2, SMOLLM2_DRAFTER
from specdraft.prompts import BUILTIN_PROMPTS
from specdraft.sequence import GenerationConfig

_VARIANTS = ["", " Answer briefly.", " Be precise."]


def _prompts(count: int) -> list[str]:
    return [BUILTIN_PROMPTS[i % len(BUILTIN_PROMPTS)].text + _VARIANTS[i // len(BUILTIN_PROMPTS) % 3]
            for i in range(count)]


def _start_server(args, port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "specdraft.cli", "serve", "--target", args.target, "--port", str(port),
               "--dtype", args.dtype, "--max-batch", str(max(args.clients, args.concurrent)),
               "--num-draft-tokens", str(args.num_draft_tokens), "--max-tokens", str(args.max_tokens)]
    command += ["--draft", args.draft] if args.draft else ["--drafter", args.drafter] if args.drafter else []
    command += ["--max-draft-batch", str(args.max_draft_batch)] if args.max_draft_batch else []
    command += ["--speculation", args.speculation]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=os.environ | {"PYTHONUNBUFFERED": "1"})


async def _stream(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> tuple[str, int]:
    """One streaming chat completion: (text, completion tokens)."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    pieces, tokens = [], 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            pieces += [c["delta"].get("content") or "" for c in chunk["choices"]]
            tokens = chunk["usage"]["completion_tokens"] if chunk.get("usage") else tokens
    return "".join(pieces), tokens


async def _round(url: str, model: str, prompts: list[str], max_tokens: int, timeout: float):
    """All prompts at once; (answers or exceptions, completion tokens, seconds)."""
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as client:
        start = time.perf_counter()
        results = await asyncio.wait_for(
            asyncio.gather(*[_stream(client, model, p, max_tokens) for p in prompts], return_exceptions=True),
            timeout)
        seconds = time.perf_counter() - start
    tokens = sum(r[1] for r in results if not isinstance(r, BaseException))
    return results, tokens, seconds


def _wait_ready(url: str, server: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and server.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.5)
    raise SystemExit(f"server did not come up: {server.stderr.read() if server.poll() is not None else 'timeout'}")


def _references(args, prompts: list[str]) -> list[str]:
    dtype = parse_dtype(args.dtype)
    target, tokenizer = load_target(args.target, dtype)
    config = GenerationConfig(args.max_tokens, args.num_draft_tokens, eos_token_ids=eos_token_ids(tokenizer,
                                                                                                  args.target))
    answers = []
    for prompt in prompts:
        drafter = load_drafter(target, tokenizer, args.draft, args.drafter, dtype)
        result = generate(target, encode_prompt(tokenizer, prompt, chat=True), drafter, config)
        answers.append(tokenizer.decode(result.token_ids, skip_special_tokens=True))
    return answers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=SMOLLM2)
    parser.add_argument("--draft", default=SMOLLM2_DRAFTER, help="draft model ('' for none)")
    parser.add_argument("--drafter", help="training-free drafter instead of --draft")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--concurrent", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--max-draft-batch", type=int, default=0, help="the server's --max-draft-batch")
    parser.add_argument("--speculation", default="adaptive", help="the server's --speculation (adaptive or fixed)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds any one round may take")
    parser.add_argument("--throughput-only", action="store_true",
                        help="skip the reference answers and the concurrent-streams check (e.g. in bf16)")
    args = parser.parse_args()
    args.draft = None if args.drafter or not args.draft else args.draft
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    server = _start_server(args, port)
    try:
        prompts = _prompts(max(args.clients, args.concurrent))
        errors, same = [], None  # None: not checked
        if not args.throughput_only:
            references = _references(args, prompts[: args.clients])
            _wait_ready(url, server, 300)
            results, tokens, seconds = asyncio.run(_round(url, args.target, prompts[: args.clients],
                                                          args.max_tokens, args.timeout))
            errors = [str(r) for r in results if isinstance(r, BaseException)]
            same = sum(1 for r, ref in zip(results, references, strict=True)
                       if not isinstance(r, BaseException) and r[0] == ref)
            print(f"{args.clients} concurrent streams: {len(errors)} errors, {same}/{args.clients} identical to "
                  f"batch-1 generate, {tokens} tokens in {seconds:.1f} s ({tokens / seconds:.1f} tokens/s)", flush=True)
        _wait_ready(url, server, 300)
        speed = {"single": [], "concurrent": []}
        for _ in range(args.rounds):
            for name, batch in (("single", prompts[:1]), ("concurrent", prompts[: args.concurrent])):
                _, count, took = asyncio.run(_round(url, args.target, batch, args.max_tokens, args.timeout))
                speed[name].append(count / took)
        single, many = (sum(v) / len(v) for v in (speed["single"], speed["concurrent"]))
        print(f"1 stream {single:.1f} tokens/s; {args.concurrent} concurrent {many:.1f} tokens/s "
              f"({many / single:.2f}x)", flush=True)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            code = server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            code = "killed after 60 s"
    print(json.dumps({"dtype": args.dtype, "draft": args.draft, "drafter": args.drafter, "clients": args.clients,
                      "max_draft_batch": args.max_draft_batch, "speculation": args.speculation,
                      "errors": errors, "identical": same, "single_tokens_per_second": speed["single"],
                      "concurrent_tokens_per_second": speed["concurrent"], "server_exit": code}))
    sys.exit(0 if not errors and same in (None, args.clients) else 1)


if __name__ == "__main__":
    main()
