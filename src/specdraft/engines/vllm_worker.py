"""The vLLM side of :mod:`specdraft.engines.vllm`: run by the vLLM environment's Python, never imported by specdraft.

    VLLM_PYTHON -P vllm_worker.py '{"model": ..., "dtype": ..., ...}'

Starts one offline engine (``vllm.LLM``) with the settings in the JSON argument, then answers requests, one JSON
line each on stdin, with one JSON line each on the protocol stream (the original stdout; vLLM's own logging and any
other output are sent to stderr). Requests:

- ``{"prompts": [[token ids], ...], "sampling": [{...SamplingParams fields...}, ...]}``: one sampling entry per
  prompt. Answer: ``{"outputs": [[completion, ...] per prompt], "seconds": engine seconds, "counters": {metric
  name: value}}``, a completion being ``{"ids", "finish_reason", "stop_reason", "prefill_seconds"}`` plus, when
  log-probabilities were asked for, ``top_ids`` / ``top_logprobs`` (per token, the top ``logprobs`` by rank), and
  ``counters`` the change of vLLM's speculative-decoding counters (``vllm:spec_decode_*``) over this request.
- ``{"quit": true}`` (or the end of stdin): exit.

Any failure is answered with ``{"error": "Type: message"}``; a failure to start exits 3 after that line. The
worker dies with its parent (``PR_SET_PDEATHSIG`` and a watchdog thread), so a killed specdraft never leaves an
engine behind.
"""

import ctypes
import json
import os
import signal
import sys
import threading
import time
import traceback

SPEC_PREFIX = "vllm:spec_decode"


def _die_with_parent(parent: int) -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True).start()


def _protocol_stream():
    """The original stdout for the protocol; fd 1 becomes stderr so that nothing else writes into it."""
    stream = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return stream


def _counters(llm) -> dict:
    """vLLM's speculative-decoding counters now (empty when the engine keeps no statistics)."""
    values = {}
    for metric in llm.get_metrics():
        if metric.name.startswith(SPEC_PREFIX):
            value = getattr(metric, "values", None)
            values[metric.name] = list(value) if value is not None else getattr(metric, "value", None)
    return values


def _delta(before: dict, after: dict) -> dict:
    out = {}
    for name, value in after.items():
        old = before.get(name)
        if isinstance(value, list):
            old = old if isinstance(old, list) else [0] * len(value)
            out[name] = [a - b for a, b in zip(value, old + [0] * (len(value) - len(old)), strict=False)]
        elif isinstance(value, (int, float)):
            out[name] = value - (old if isinstance(old, (int, float)) else 0)
    return out


def _top(logprobs, k: int) -> tuple[list, list]:
    """Per token, the ``k`` best (id, log p) by vLLM's rank (it adds the chosen token when that is not among them)."""
    ids, values = [], []
    for position in logprobs:
        best = sorted(position.items(), key=lambda item: (item[1].rank, -item[1].logprob))[:k]
        ids.append([int(token) for token, _ in best])
        values.append([float(entry.logprob) for _, entry in best])
    return ids, values


def _completion(request, completion, k: int | None) -> dict:
    metrics = getattr(request, "metrics", None)
    first = getattr(metrics, "first_token_ts", None) or 0.0
    scheduled = getattr(metrics, "scheduled_ts", None) or 0.0
    out = {"ids": [int(t) for t in completion.token_ids], "finish_reason": completion.finish_reason,
           "stop_reason": completion.stop_reason if isinstance(completion.stop_reason, (int, str)) else None,
           "prefill_seconds": first - scheduled if first and scheduled else None}
    spec = getattr(completion, "spec_decode_metrics", None)
    if spec is not None:
        out["spec_decode"] = spec.to_dict()
    if k:
        out["top_ids"], out["top_logprobs"] = _top(completion.logprobs or [], k)
    return out


def _generate(llm, request: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]]
    params = [SamplingParams(**fields) for fields in request["sampling"]]
    before = _counters(llm)
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    outputs = [[_completion(r, c, p.logprobs) for c in r.outputs] for r, p in zip(results, params, strict=True)]
    return {"outputs": outputs, "seconds": seconds, "counters": _delta(before, _counters(llm))}


def _error(exc: BaseException) -> dict:
    traceback.print_exc(file=sys.stderr)
    return {"error": f"{type(exc).__name__}: {exc}"}


def main() -> int:
    settings = json.loads(sys.argv[1])
    _die_with_parent(int(settings.pop("parent_pid", os.getppid())))
    reply = _protocol_stream()
    try:
        import vllm

        started = time.perf_counter()
        llm = vllm.LLM(**settings)
    except BaseException as exc:  # vLLM's own error is the answer
        reply.write(json.dumps(_error(exc)) + "\n")
        return 3
    reply.write(json.dumps({"ready": True, "version": vllm.__version__,
                            "load_seconds": time.perf_counter() - started}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        if request.get("quit"):
            break
        try:
            answer = _generate(llm, request)
        except Exception as exc:  # a bad request is answered; the engine stays up
            answer = _error(exc)
        reply.write(json.dumps(answer) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
