"""JSON-schema answers of the built-in target (SmolLM2-135M-Instruct) through ``specdraft serve`` and the OpenAI
SDK's ``parse``: validity, greedy equality with speculation off, τ and tokens/s.

Two servers run side by side, each a ``specdraft serve`` process of its own on a loopback port: ``speculative``
(the shipped drafter, fixed γ, and the grammar drafter, as every JSON ``response_format`` request gets it) and
``plain`` (no drafter, ``--no-grammar-draft``: plain constrained decoding). Each request (a Pydantic model with
nested objects, enums, arrays and numbers, from ``structured_smollm2.py``, and a question) goes through
``client.chat.completions.parse(response_format=Model)`` in turn: greedy to the speculative server, greedy to the
plain one, then at temperature 0.8 (seeded) to the speculative one; one request at a time, so the servers never
decode together. An answer is valid when ``parse`` returns the model's instance; one cut by the token budget
(``finish_reason: "length"``, the SDK's ``LengthFinishReasonError``) is counted as such and is not valid. τ comes
from each answer's ``usage.speculation`` (tokens over target forwards), tokens/s from ``usage.completion_tokens``
over the client's wall time (HTTP included).

    OMP_NUM_THREADS=1 PYTHONPATH=src .venv/bin/python benchmarks/structured_sdk.py [--requests 50] \
        [--max-tokens 256] [--num-draft-tokens 4] [--dtype auto|float32] [--no-sampled]

Needs the grammar and serve extras and the ``openai`` package. Prints one line per request and a summary, then one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
from pydantic import BaseModel, ValidationError
from structured_smollm2 import requests

from specdraft.models.registry import SMOLLM2, SMOLLM2_DRAFTER

SERVERS = {"speculative": ["--draft", SMOLLM2_DRAFTER], "plain": ["--no-grammar-draft"]}


def start_server(name: str, extra: list[str], args: argparse.Namespace, logs: Path) -> tuple[subprocess.Popen, str]:
    """``specdraft serve`` for the built-in target on a free loopback port, once ``/health`` answers."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "specdraft.cli", "serve", "--target", SMOLLM2, "--port", str(port),
               "--served-model-name", "smollm2", "--speculation", "fixed", "--num-draft-tokens",
               str(args.num_draft_tokens), "--max-batch", "1", "--max-tokens", str(args.max_tokens), "--dtype",
               args.dtype, *extra]
    log = logs / f"{name}.log"
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"the {name} server did not start: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, url
        except httpx.TransportError:
            time.sleep(0.5)


def ask(client: openai.OpenAI, model: type[BaseModel], question: str, max_tokens: int, temperature: float,
        seed: int | None) -> dict:
    """One ``parse`` call: its content, finish reason, whether it validated, tokens, forwards and seconds."""
    schema = json.dumps(model.model_json_schema())
    messages = [{"role": "system", "content": f"Answer only with JSON that follows this schema: {schema}"},
                {"role": "user", "content": f"Give me {model.__name__.lower()} data for {question}."}]
    start = time.perf_counter()
    try:
        completion = client.chat.completions.parse(model="smollm2", messages=messages, response_format=model,
                                                   max_tokens=max_tokens, temperature=temperature, seed=seed)
        finish, valid = completion.choices[0].finish_reason, isinstance(completion.choices[0].message.parsed, model)
    except openai.LengthFinishReasonError as exc:
        completion, finish, valid = exc.completion, "length", False
    except ValidationError:  # the answer ended but does not validate: the failure this benchmark looks for
        return {"content": None, "finish": "stop", "valid": False, "tokens": 0, "forwards": 0,
                "seconds": time.perf_counter() - start}
    seconds = time.perf_counter() - start
    speculation = completion.usage.model_extra.get("speculation") or {}
    return {"content": completion.choices[0].message.content, "finish": finish, "valid": valid,
            "tokens": completion.usage.completion_tokens, "forwards": speculation.get("target_forward_calls", 0),
            "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--dtype", choices=("auto", "float32"), default="auto",
                        help="the servers' --dtype: auto (the GGUF blocks) or float32 (dense)")
    parser.add_argument("--no-sampled", action="store_true", help="leave out the sampled run")
    args = parser.parse_args()
    runs = [("speculative", "greedy", 0.0), ("plain", "greedy", 0.0)] + \
        ([] if args.no_sampled else [("speculative", "sampled", 0.8)])
    logs = Path(tempfile.mkdtemp(prefix="specdraft-sdk-"))
    servers = {name: start_server(name, extra, args, logs) for name, extra in SERVERS.items()}
    try:
        clients = {name: openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=900)
                   for name, (_, url) in servers.items()}
        for client in clients.values():  # warm-up: compiles the grammar path once per server
            ask(client, *requests(1)[0], 8, 0.0, None)
        rows = []
        for i, (model, question) in enumerate(requests(args.requests)):
            outs = {f"{server}_{kind}": ask(clients[server], model, question, args.max_tokens, temperature,
                                            i if temperature else None) for server, kind, temperature in runs}
            row = {"schema": model.__name__, "question": question,
                   "equal": outs["speculative_greedy"]["content"] == outs["plain_greedy"]["content"]} | outs
            rows.append(row)
            print(f"{i:2d} {model.__name__:8s} equal {row['equal']} " + " ".join(
                f"{name}: {out['finish']}/{'valid' if out['valid'] else 'INVALID'} {out['tokens']} tok "
                f"{out['forwards']} fwd {out['seconds']:.1f} s" for name, out in outs.items()), flush=True)
    finally:
        for process, _ in servers.values():
            process.terminate()
        for process, _ in servers.values():
            process.wait(30)
    summary = {}
    for name in rows[0] if rows else []:
        if not isinstance(rows[0][name], dict):
            continue
        outs = [row[name] for row in rows]
        tokens, forwards, seconds = (sum(out[key] for out in outs) for key in ("tokens", "forwards", "seconds"))
        summary[name] = {"valid": sum(out["valid"] for out in outs), "length": sum(out["finish"] == "length"
                                                                                    for out in outs),
                         "tokens": tokens, "forwards": forwards, "seconds": round(seconds, 2),
                         "tau": round(tokens / forwards, 3) if forwards else None,
                         "tokens_per_second": round(tokens / seconds, 2)}
    equal = sum(row["equal"] for row in rows)
    print(f"{len(rows)} requests, greedy speculative equal to plain: {equal}/{len(rows)}; " + "; ".join(
        f"{name}: valid {s['valid']}, length {s['length']}, τ {s['tau']}, {s['tokens_per_second']:.1f} tokens/s"
        for name, s in summary.items()))
    print(json.dumps({"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                      "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "max_tokens": args.max_tokens,
                      "dtype": args.dtype,
                      "num_draft_tokens": args.num_draft_tokens, "equal": equal, "summary": summary, "rows": rows}))


if __name__ == "__main__":
    main()
