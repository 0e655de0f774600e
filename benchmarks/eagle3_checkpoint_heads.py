"""A heads folder from an EAGLE-3 training checkpoint (``<run>/checkpoint.pt`` of ``train-heads --kind eagle3``),
to evaluate a run while it trains. The spec is rebuilt from the run's own config (sizes from the target, settings
from --options); the weights, d2t and t2d come from the checkpoint.
Usage: eagle3_checkpoint_heads.py RUN_DIR OUT_HEADS [--dtype bfloat16]"""

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoConfig

from specdraft.heads import save_heads
from specdraft.heads.eagle import head_config
from specdraft.heads.eagle3 import build_eagle3
from specdraft.models.registry import resolve
from specdraft.training.heads.eagle3 import parse_settings
from specdraft.training.heads.train_heads import HeadsConfig
from specdraft.training.runs.checkpoint import load_training_state

parser = argparse.ArgumentParser()
parser.add_argument("run")
parser.add_argument("out")
parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
args = parser.parse_args()

state = load_training_state(Path(args.run) / "checkpoint.pt")
config = HeadsConfig(**state["config"])
target_config = AutoConfig.from_pretrained(resolve(config.target))
spec = head_config(target_config) | parse_settings(config.kind_options(), target_config.num_hidden_layers,
                                                   target_config.vocab_size)
head = build_eagle3(dict(spec))
head.load_state_dict(state["model"])
card = (f"# EAGLE-3 heads at step {state['step']} of `{args.run}`\n\n{state['tokens']:,} training tokens, "
        f"{state['wall_seconds']:.0f} s.\n\n```json\n{json.dumps(state['config'], indent=1)}\n```\n")
save_heads(head, "eagle3", spec, args.out, config.target, card, getattr(torch, args.dtype))
print(f"{args.out}: step {state['step']}, {state['tokens']} tokens")
