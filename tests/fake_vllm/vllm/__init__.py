"""A stand-in for the ``vllm`` package in the default tests: ``LLM`` computes with transformers on the same
checkpoint (greedy, or sampling from the softmax with the request's seed), with vLLM's output objects, log-probs
(top-k by rank, plus the chosen token when it is not among them), per-request spec-decode metrics and Prometheus
counters. ``FAKE_VLLM_FAIL_START`` makes the start fail with that message; ``FAKE_VLLM_SLEEP`` makes every generate
call sleep that many seconds first, without loading a model, and ``FAKE_VLLM_SLOW_AFTER=N`` makes every call after
the first N sleep 60 seconds first (both to kill the parent meanwhile). torch and transformers are imported only
when a model is loaded."""

import os
import time
from dataclasses import dataclass, field

__version__ = "0.0-fake"


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list = field(default_factory=list)
    logprobs: int | None = None
    detokenize: bool = True


@dataclass
class Logprob:
    logprob: float
    rank: int


@dataclass
class Completion:
    token_ids: list
    finish_reason: str
    stop_reason: object = None
    logprobs: list | None = None
    spec_decode_metrics: object = None


@dataclass
class SpecMetrics:
    accepted: list
    drafted: list

    def to_dict(self):
        return {"num_accepted_draft_tokens": sum(self.accepted), "num_draft_tokens": sum(self.drafted),
                "per_step_accepted": self.accepted, "per_step_drafted": self.drafted}


@dataclass
class Metric:
    name: str
    value: float = 0
    values: list | None = None


class RequestOutput:
    def __init__(self, outputs):
        self.outputs = outputs
        self.metrics = type("Stats", (), {"scheduled_ts": 1.0, "first_token_ts": 1.25})()


class LLM:
    def __init__(self, model, dtype="float32", speculative_config=None, **kwargs):
        if os.environ.get("FAKE_VLLM_FAIL_START"):
            raise ValueError(os.environ["FAKE_VLLM_FAIL_START"])
        if not os.environ.get("FAKE_VLLM_SLEEP"):
            import torch
            from transformers import AutoModelForCausalLM

            self.model = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
        self.speculative = speculative_config
        self.kwargs = kwargs
        self.calls = 0
        self.counts = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}

    def get_metrics(self):
        if not self.speculative:
            return [Metric("vllm:num_requests_running", 0)]
        k = self.speculative["num_speculative_tokens"]
        per_position = [self.counts["accepted_tokens"]] + [0] * (k - 1)
        return [Metric(f"vllm:spec_decode_num_{name}", value) for name, value in self.counts.items()] + [
            Metric("vllm:spec_decode_num_accepted_tokens_per_pos", values=per_position)]

    def _one(self, ids, params, seed):
        import torch

        with torch.inference_mode():
            return self._decode(torch, ids, params, seed)

    def _decode(self, torch, ids, params, seed):
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        tokens, logprobs = [], []
        for _ in range(params.max_tokens):
            logits = self.model(torch.tensor([ids + tokens])).logits[0, -1].float()  # (V,)
            log_p = torch.log_softmax(logits, -1)
            if params.temperature == 0:
                token = int(logits.argmax())
            else:
                token = int(torch.multinomial(torch.softmax(logits / params.temperature, -1), 1, generator=generator))
            if params.logprobs:
                top = log_p.topk(params.logprobs)
                pairs = zip(top.indices.tolist(), top.values.tolist(), strict=True)
                entry = {i: Logprob(v, rank + 1) for rank, (i, v) in enumerate(pairs)}
                if token not in entry:
                    entry[token] = Logprob(float(log_p[token]), int((log_p > log_p[token]).sum()) + 1)
                logprobs.append(entry)
            tokens.append(token)
            if token in params.stop_token_ids:
                return tokens, "stop", logprobs
        return tokens, "length", logprobs

    def generate(self, prompts, params, use_tqdm=False):
        if os.environ.get("FAKE_VLLM_SLEEP"):
            time.sleep(float(os.environ["FAKE_VLLM_SLEEP"]))
        self.calls += 1
        if self.calls > int(os.environ.get("FAKE_VLLM_SLOW_AFTER", "1000000")):
            time.sleep(60)
        outputs = []
        for prompt, p in zip(prompts, params, strict=True):
            completions = []
            for child in range(p.n):
                tokens, reason, logprobs = self._one(list(prompt["prompt_token_ids"]), p,
                                                     None if p.seed is None else p.seed + child)
                spec = None
                if self.speculative:  # pretend every step drafted k tokens and accepted one
                    k, steps = self.speculative["num_speculative_tokens"], max(0, (len(tokens) - 1) // 2)
                    spec = SpecMetrics([1] * steps, [k] * steps)
                    self.counts["drafts"] += steps
                    self.counts["draft_tokens"] += k * steps
                    self.counts["accepted_tokens"] += steps
                completions.append(Completion(tokens, reason, None, logprobs if p.logprobs else None, spec))
            outputs.append(RequestOutput(completions))
        return outputs
