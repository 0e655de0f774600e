"""bf16 autocast against fp32 for distillation fine-tuning steps on the real target, on this CPU's native paths and on
its AVX2 paths (``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2``) and with only
torch's own kernels at AVX2 (``ATEN_CPU_CAPABILITY=avx2``), with what the ``auto`` precision chooses under each.

A finetune step is what ``specdraft finetune`` does per batch: the target's forward under ``no_grad`` (p), the
drafter's forward and backward with forward KL, AdamW; a pretrain step is the drafter's alone with cross-entropy.
The drafter is the ``small`` preset (2 layers, d 192, the target's 49k vocabulary). fp32 and bf16 steps alternate
in one process, so a shared machine's load hits both alike; each machine kind is its own process (the variables
act at start-up). Reported: median seconds a step and tokens/s.

    .venv/bin/python benchmarks/dtype_training.py [--steps 5] [--batch-size 2] [--seq-len 128]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def measure(steps: int, batch_size: int, seq_len: int) -> dict:
    """Median step seconds for fp32 and bf16 autocast, alternating, after one warm-up step of each."""
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    from specdraft.hardware import cpu_capability, fast_dtype
    from specdraft.models.registry import SMOLLM2, load_model, resolve
    from specdraft.training.drafter.init_drafter import DrafterConfig
    from specdraft.training.objectives.losses import distillation_loss

    torch.manual_seed(0)
    target = load_model(SMOLLM2, torch.float32, backend="hf").model.eval().requires_grad_(False)
    drafter = LlamaForCausalLM(DrafterConfig(preset="small").llama_config(AutoConfig.from_pretrained(resolve(SMOLLM2))))
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
    ids = torch.randint(0, target.config.vocab_size, (batch_size, seq_len + 1))  # (B, T + 1)
    mask = torch.ones(batch_size, seq_len, dtype=torch.bool)  # (B, T)

    def step(bf16: bool, kind: str) -> float:
        started = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            q_logits = drafter(input_ids=ids[:, :-1], use_cache=False).logits  # (B, T, V)
            if kind == "finetune":
                with torch.no_grad():
                    p_logits = target(input_ids=ids[:, :-1], use_cache=False).logits  # (B, T, V)
                loss = distillation_loss("fkl", q_logits, p_logits, ids[:, 1:], mask)
            else:
                loss = distillation_loss("ce", q_logits, None, ids[:, 1:], mask)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - started

    result = {}
    for kind in ("pretrain", "finetune"):
        times: dict[str, list[float]] = {"fp32": [], "bf16": []}
        step(False, kind), step(True, kind)  # warm-up
        for _ in range(steps):
            for name, bf16 in (("fp32", False), ("bf16", True)):
                times[name].append(step(bf16, kind))
        medians = {name: statistics.median(t) for name, t in times.items()}
        result[kind] = {f"{name}_s_per_step": round(m, 3) for name, m in medians.items()} | {
            f"{name}_tokens_per_s": round(batch_size * seq_len / m) for name, m in medians.items()} | {
            "bf16_speedup": round(medians["fp32"] / medians["bf16"], 2)}
    choice = fast_dtype("cpu")
    return result | {"torch_capability": cpu_capability(), "auto": choice.dtype, "auto_reason": choice.reason,
                     "threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.steps, args.batch_size, args.seq_len)))
        return
    report = {}
    for machine, env in (("native", {}), ("avx2 paths", AVX2), ("torch avx2 only", {"ATEN_CPU_CAPABILITY": "avx2"})):
        cmd = [sys.executable, __file__, "--child", "--steps", str(args.steps), "--batch-size", str(args.batch_size),
               "--seq-len", str(args.seq_len)]
        out = subprocess.run(cmd, env=os.environ | env, capture_output=True, text=True, check=True).stdout
        report[machine] = json.loads(out.strip().splitlines()[-1])
        print(machine, json.dumps(report[machine]), flush=True)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
