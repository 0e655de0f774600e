"""A distill-data-format folder of ShareGPT's own first replies (the train split's opening prompts, tokenized with
the target's chat template; the dataset's first "gpt" turn as the response, cut at --max-tokens). EAGLE-3 heads
learn the target's distribution on the fly, so fixed replies work as training text (EAGLE and EAGLE-3 train on
ShareGPT this way); records share prompt ids with `distill-data`'s, so held-out prompts stay held out in a folder
that mixes both. Usage: sharegpt_replies.py OUT [--target smollm2-135m-instruct] [--max-tokens 192]"""

import argparse
import json
from pathlib import Path

from specdraft.corpus import iter_sharegpt, sharegpt_prompts
from specdraft.models.registry import load_tokenizer
from specdraft.training.runs.folders import shard_entries

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--target", default="smollm2-135m-instruct")
parser.add_argument("--max-tokens", type=int, default=192)
parser.add_argument("--shard-size", type=int, default=256)
args = parser.parse_args()

tokenizer = load_tokenizer(args.target)
prompts = {p.id: p for p in sharegpt_prompts(split="train")}
replies = {}
for conversation in iter_sharegpt():
    turns = conversation["conversations"]
    if conversation["id"] in prompts and len(turns) > 1 and turns[1].get("from") == "gpt":
        text = turns[1].get("value")
        if isinstance(text, str) and text.strip():
            replies[conversation["id"]] = text.strip()
out = Path(args.out)
out.mkdir(parents=True, exist_ok=True)
records = []
for pid, prompt in prompts.items():
    if pid not in replies:
        continue
    messages = prompt.messages()
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    prompt_ids = list(encoded["input_ids"])
    ids = tokenizer(replies[pid], add_special_tokens=False)["input_ids"]
    response = ids[: args.max_tokens] if len(ids) >= args.max_tokens else ids + [tokenizer.eos_token_id]
    records.append({"prompt_id": f"sharegpt:{pid}", "messages": messages, "prompt_token_ids": prompt_ids,
                    "response_token_ids": response, "source": "sharegpt reply"})
shards = {}
for index in range(0, len(records), args.shard_size):
    name = f"reply-{index // args.shard_size:05d}.jsonl"
    (out / name).write_text("".join(json.dumps(r) + "\n" for r in records[index : index + args.shard_size]))
    shards[name] = len(records[index : index + args.shard_size])
manifest = {"num_shards": len(shards), "complete": True, "shards": shards, "records": len(records),
            "sha256": shard_entries(out, sorted(shards))[1],
            "config": {"prompts": "sharegpt", "split": "train", "responses": "dataset", "max_tokens": args.max_tokens}}
(out / "manifest.json").write_text(json.dumps(manifest, indent=1))
print(f"{out}: {len(records)} records in {len(shards)} shards")
