"""``specdraft`` command line: one subcommand per job, each building a config and calling one library function.

Every user error (bad value, unknown model, vocabulary mismatch, a file that cannot be read or written, a folder
where a file belongs, a full disk, ...) ends with one line on stderr and exit code 2; a traceback means a bug.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch

from specdraft.decoding import PrefixCache, generate
from specdraft.drafters import NAMED_DRAFTERS, facts_of, load_drafter, parse_options
from specdraft.errors import SpecdraftError, os_error, utf8_error
from specdraft.hardware import resolve_device
from specdraft.models.registry import (
    DTYPE_CHOICES,
    DTYPES,
    QUANTIZE,
    choose_precision,
    eos_token_ids,
    load_target,
    parse_dtype,
)
from specdraft.prompts import encode_prompt
from specdraft.sampling import SamplingConfig
from specdraft.sequence import SPECULATION_HELP, GenerationConfig, speculation_policy
from specdraft.serve.online_config import ONLINE_LOSSES
from specdraft.speculation import SPECULATION
from specdraft.training.commands import add_training_commands


def _add_precision(p, dense_default: str) -> None:
    """--dtype and --quantize (:func:`specdraft.models.registry.choose_precision`)."""
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                   help=f"auto (default): a GGUF target decodes from its quantized blocks, other targets in "
                        f"{dense_default}; float32 or bfloat16: dense weights in that dtype (drafters too)")
    p.add_argument("--quantize", choices=QUANTIZE, default="auto",
                   help="target weights: auto (a GGUF target's own blocks unless --dtype is given), none (dense), "
                        "gguf, "
                        "or int8 / int4 (a dense checkpoint rounded to Q8_0 / Q4_1 blocks at load: lossy)")
    _add_kv_cache(p)


def _add_kv_cache(p) -> None:
    p.add_argument("--kv-cache", choices=("auto", "float32", "float16", "bfloat16"), default="auto",
                   help="the KV cache format of a quantized target (and drafter): auto (the default, "
                        "docs/quantized.md) or a dtype; part of the model's arithmetic, for plain and speculative "
                        "decoding alike")


def _prompt_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SpecdraftError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise SpecdraftError("empty prompt: --prompt-ids has no ids")
    return ids


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text, speculatively when a drafter is given")
    p.add_argument("--target", required=True, help="built-in name, checkpoint folder or cached hub id")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--draft", help="draft model: built-in name, checkpoint folder or cached hub id")
    how.add_argument("--drafter", choices=sorted(NAMED_DRAFTERS), help="a drafter by name (no draft model)")
    p.add_argument("--drafter-option", action="append", default=[], metavar="KEY=VALUE",
                   help="drafter option (repeatable), e.g. max_ngram_size=4 for prompt-lookup, or "
                        "tree_branching=2 and tree_nodes=12 for a draft model's token tree, confidence_threshold=0.4 "
                        "to stop its chain at an unsure token")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="prompt text")
    what.add_argument("--prompt-ids", type=_prompt_ids, help="prompt token ids, e.g. 1,2,3")
    p.add_argument("--chat", action="store_true", help="wrap --prompt in the tokenizer's chat template")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--num-draft-tokens", type=int, default=4, help="γ, draft tokens per target forward (the most, "
                                                                   "with adaptive speculation)")
    p.add_argument("--speculation", choices=SPECULATION, default="adaptive", help=SPECULATION_HELP)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n", type=int, default=1, help="independent completions (seeds seed, seed+1, ...)")
    _add_precision(p, "float32")
    p.add_argument("--backend", choices=("auto", "native", "hf"), default="auto")
    p.add_argument("--device", default="cpu", help=DEVICE_HELP)
    p.add_argument("--json", action="store_true", help="one JSON object per completion")
    p.set_defaults(run=_run_generate)


DEVICE_HELP = ("where the target (and a draft model) run: cpu (default), auto (CUDA when visible), cuda or cuda:N; "
               "on CUDA models run through transformers (--backend auto or hf)")


def decoding_device(device: str, backend: str, drafter: str | None = None) -> str:
    """The resolved device name for decoding, refusing what only runs on the CPU (the native backend, a drafter
    whose facts say ``cpu_only``: the heads and layer-skip drafters)."""

    try:
        name = resolve_device(device).name
    except ValueError as exc:
        raise SpecdraftError(str(exc)) from None
    if name != "cpu" and backend == "native":
        raise SpecdraftError(f"--backend native decodes on the CPU; on {name} use --backend hf (or auto)")
    if name != "cpu" and drafter in NAMED_DRAFTERS and facts_of(NAMED_DRAFTERS[drafter]).cpu_only:
        raise SpecdraftError(f"--drafter {drafter} drafts on the CPU beside a CPU target; use --device cpu")
    return name


def _run_generate(args: argparse.Namespace) -> None:
    if args.n < 1:
        raise SpecdraftError(f"--n must be >= 1, got {args.n}")
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
    device = decoding_device(args.device, args.backend, args.drafter)
    quantize = "none" if device != "cpu" and args.quantize == "auto" else args.quantize  # blocks run on the CPU
    precision = choose_precision(args.target, args.dtype, quantize, torch.float32)
    target, tokenizer = load_target(args.target, precision.dtype, args.backend, precision.quantize, device=device)
    config = GenerationConfig(args.max_new_tokens, args.num_draft_tokens, sampling,
                              eos_token_ids(tokenizer, args.target), tuple(args.stop), args.speculation)
    drafter = load_drafter(target, tokenizer, args.draft, args.drafter, precision.draft_dtype, args.backend,
                           parse_options(args.drafter_option))
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    policy = speculation_policy(config, target, drafter, log)  # one for every completion: it learns across them
    ids = args.prompt_ids if args.prompt_ids is not None else encode_prompt(tokenizer, args.prompt, args.chat)
    kept = PrefixCache()  # the --n completions share their prompt: read once where the target reads it exactly
    for i in range(args.n):
        result = generate(target, ids, drafter, config, torch.Generator().manual_seed(args.seed + i), tokenizer,
                          policy, prefix_cache=kept)
        text = tokenizer.decode(result.token_ids, skip_special_tokens=True)
        if args.json:
            record = {"token_ids": result.token_ids, "text": text, "finish_reason": result.finish_reason,
                      "stats": result.stats.to_dict()}
            print(json.dumps(record), flush=True)
        else:
            s = result.stats
            print(text, flush=True)
            print(f"[{s.new_tokens} tokens, {s.tokens_per_second:.1f} tokens/s, block efficiency "
                  f"{s.block_efficiency:.2f}, {result.finish_reason}]", file=sys.stderr)


def _add_demo(sub) -> None:
    from specdraft.demo import DEMO_DRAFTERS

    p = sub.add_parser("demo", help="SmolLM2-135M-Instruct on built-in chat prompts, plain vs each drafter")
    p.add_argument("--draft", help="draft model to run (default: the shipped smollm2-135m-instruct-drafter)")
    p.add_argument("--drafters", default=",".join(DEMO_DRAFTERS),
                   help=f"comma-separated training-free drafters to show (default: {','.join(DEMO_DRAFTERS)})")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3,
                   help="rounds of every method over every prompt; the table gives medians over them (default 3)")
    p.add_argument("--dtype", choices=["auto", *sorted(DTYPES)], default="auto",
                   help="auto (default): the fastest path of this CPU (the built-in GGUF's own blocks through the "
                        "int8 kernels, else bfloat16 with AVX-512 bf16 or the AVX2 row kernel, else float32); a "
                        "dense dtype's identity to plain decoding is checked in float32 beside it")
    p.add_argument("--quantize", choices=QUANTIZE, default="auto",
                   help="target weights: auto (the built-in GGUF's own blocks where the int8 kernels build, unless "
                        "--dtype is given), none, gguf, int8 or int4")
    p.add_argument("--speculation", choices=SPECULATION, default="adaptive", help=SPECULATION_HELP)
    _add_kv_cache(p)
    p.set_defaults(run=_run_demo)


def _run_demo(args: argparse.Namespace) -> None:
    from specdraft.demo import DemoConfig, run_demo

    if args.num_prompts < 1 or args.repeats < 1:
        raise SpecdraftError(f"--num-prompts and --repeats must be >= 1, got {args.num_prompts}, {args.repeats}")
    GenerationConfig(args.max_new_tokens, args.num_draft_tokens)  # validates both
    drafters = tuple(name.strip() for name in args.drafters.split(",") if name.strip())
    run_demo(DemoConfig(draft=args.draft, num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens,
                        num_draft_tokens=args.num_draft_tokens, dtype=None if args.dtype == "auto" else
                        parse_dtype(args.dtype), drafters=drafters, speculation=args.speculation,
                        quantize=args.quantize, repeats=args.repeats))


def _add_bench(sub) -> None:
    from specdraft.bench.config import default_methods
    from specdraft.bench.questions import BUILTIN, SUBTASKS
    from specdraft.models.registry import SMOLLM2

    p = sub.add_parser("bench", help="Spec-Bench-style benchmark: answer records, summary.json/.md and plots")
    p.add_argument("--out", required=True, help="output folder (resumed when it holds the same run)")
    p.add_argument("--target", default=SMOLLM2, help="built-in name, checkpoint folder or cached hub id")
    p.add_argument("--methods", default=",".join(default_methods()),
                   help="comma-separated: ar, draft:PATH, hf, hf-assisted:PATH, llama.cpp, "
                        "llama.cpp-draft:DRAFT.gguf, llama.cpp-eagle3:EAGLE3.gguf, llama.cpp-dflash:DFLASH.gguf, "
                        "llama.cpp-ngram:MODE (llama.cpp "
                        "options after ';', e.g. 'llama.cpp-draft:d.gguf;n_max=2;p_min=0.75'), "
                        "vllm, vllm-ngram, vllm-draft:PATH, vllm-eagle3:PATH, or a "
                        f"drafter by name ({', '.join(sorted(NAMED_DRAFTERS))}); ar always runs")
    p.add_argument("--questions", default=BUILTIN,
                   help="Spec-Bench-format question JSONL file, 'builtin', or 'sharegpt-heldout'")
    p.add_argument("--categories", help=f"comma-separated subtasks to keep ({', '.join(SUBTASKS)})")
    p.add_argument("--per-category", type=int, help="first N questions of each subtask")
    p.add_argument("--max-new-tokens", type=int, default=128, help="most tokens per turn")
    p.add_argument("--num-draft-tokens", type=int, default=4, help="γ, draft tokens per target forward")
    p.add_argument("--sweep", help="run every speculative method at each γ, e.g. num_draft_tokens=1,2,4,8")
    p.add_argument("--speculation", default="adaptive",
                   help="comma-separated policies each speculative method runs with: adaptive (the default; each "
                        "step priced by this machine's costs), fixed (γ always; named NAME+fixed beside adaptive)")
    p.add_argument("--repeats", type=int, default=1, help="timing repeats per question and method")
    _add_precision(p, "bfloat16")
    p.add_argument("--device", default="cpu", help="where the target and draft models run: cpu (default), auto, "
                                                   "cuda or cuda:N (on CUDA through transformers, dense weights)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="every answer reads its whole prompt (default: each method reads only what its prompt does "
                        "not share with its last one, as a server's prefix cache does)")
    p.add_argument("--report-only", action="store_true", help="only (re)write the report from the records in --out")
    p.add_argument("--overwrite", action="store_true", help="discard answers of a different run in --out")
    p.set_defaults(run=_run_bench)


def _bench_command(args: argparse.Namespace) -> list[str]:
    """The run as one canonical command line (recorded in run.json)."""
    command = ["specdraft", "bench"]
    for key, value in vars(args).items():
        if key in ("command", "run", "report_only", "overwrite") or value is None or value is False:
            continue
        if value is True:
            command.append(f"--{key.replace('_', '-')}")
            continue
        command += [f"--{key.replace('_', '-')}", str(value)]
    return command


def _run_bench(args: argparse.Namespace) -> None:
    from specdraft.bench.config import BenchConfig, parse_list, parse_sweep
    from specdraft.bench.report import render_markdown, write_report
    from specdraft.bench.runner import run_bench

    if args.report_only:
        summary = write_report(args.out)
    else:
        config = BenchConfig(
            out=args.out, target=args.target, methods=parse_list(args.methods) or (), questions=args.questions,
            categories=parse_list(args.categories), per_category=args.per_category,
            max_new_tokens=args.max_new_tokens, num_draft_tokens=args.num_draft_tokens,
            sweep=parse_sweep(args.sweep) if args.sweep else None, repeats=args.repeats, dtype=args.dtype,
            quantize=args.quantize, device=decoding_device(args.device, "auto"),
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
            speculation=parse_list(args.speculation) or (), prefix_cache=not args.no_prefix_cache,
        )
        summary = run_bench(config, command=_bench_command(args), overwrite=args.overwrite)
    print(render_markdown(summary), flush=True)


def _add_calibrate(sub) -> None:
    p = sub.add_parser("calibrate", help="measure (or show the cached) forward cost of a model on this machine")
    p.add_argument("--target", default=None, help="model (default: smollm2-135m-instruct)")
    p.add_argument("--draft", help="also a draft model: built-in name, checkpoint folder or cached hub id")
    _add_precision(p, "float32")
    p.add_argument("--refresh", action="store_true", help="measure again even when a cached curve exists")
    p.add_argument("--json", action="store_true", help="print the curves as JSON")
    p.set_defaults(run=_run_calibrate)


def _run_calibrate(args: argparse.Namespace) -> None:
    from specdraft.api import load_draft_model
    from specdraft.costs import cost_curve, describe
    from specdraft.models.registry import SMOLLM2

    name = args.target or SMOLLM2
    precision = choose_precision(name, args.dtype, args.quantize, torch.float32)
    target, tokenizer = load_target(name, precision.dtype, quantize=precision.quantize)
    drafts = [load_draft_model(target, tokenizer, args.draft, precision.draft_dtype)] if args.draft else []
    models = [target, *drafts]
    log = None if args.json else (lambda line: print(line, file=sys.stderr, flush=True))
    curves = [cost_curve(model, refresh=args.refresh, log=log) for model in models]
    if args.json:
        print(json.dumps([curve.to_dict() for curve in curves], indent=1))
        return
    for curve in curves:
        print("\n".join(describe(curve)), flush=True)


def _add_build_datastore(sub) -> None:
    from specdraft.models.registry import SMOLLM2

    p = sub.add_parser("build-datastore", help="index a corpus for the rest drafter (REST, He et al. 2023)")
    p.add_argument("--target", default=SMOLLM2, help="model whose tokenizer tokenises the corpus")
    p.add_argument("--source", default="sharegpt",
                   help="'sharegpt' (assistant turns, train split) or a .txt/.jsonl file or folder")
    p.add_argument("--out", help="datastore folder (default: under the specdraft cache, named for source and "
                                 "tokenizer, where the rest drafter looks by default)")
    p.add_argument("--max-docs", type=int, help="index only the first N documents")
    p.add_argument("--if-missing", action="store_true",
                   help="do nothing when the folder already holds a datastore that loads (make demo uses this)")
    p.set_defaults(run=_run_build_datastore)


def _run_build_datastore(args: argparse.Namespace) -> None:
    import time

    from specdraft import datastore
    from specdraft.models.registry import load_tokenizer

    started = time.perf_counter()
    tokenizer = load_tokenizer(args.target)
    if args.if_missing:
        from specdraft.compat import tokenizer_fingerprint

        where = args.out or datastore.default_dir(args.source, tokenizer_fingerprint(tokenizer))
        try:
            datastore.load(where, tokenizer, verify=False)
            print(f"datastore {where} is present; not rebuilding it")
            return
        except SpecdraftError:
            pass
    out, manifest = datastore.build(tokenizer, args.source, args.out, args.max_docs)
    size = sum(f["bytes"] for f in manifest["files"].values())
    print(f"datastore {out}: {manifest['documents']} documents, {manifest['tokens']} tokens, index "
          f"{size / 2**20:.1f} MiB on disk, built in {manifest['build_seconds']:.1f} s "
          f"({time.perf_counter() - started:.1f} s with loading and saving)")


def _add_build_ngram(sub) -> None:
    from specdraft.models.registry import SMOLLM2

    p = sub.add_parser("build-ngram", help="an n-gram table of the target's answers for the ngram drafter")
    p.add_argument("--answers", required=True,
                   help="JSON Lines (.gz too) of the target's answers: a prompt and 'answer_ids' a record, as "
                        "distill-data --answers reads")
    p.add_argument("--target", default=SMOLLM2, help="the model that wrote the answers (its tokenizer is recorded)")
    p.add_argument("--out", required=True, help="table folder (written beside, then renamed into place)")
    p.add_argument("--max-order", type=int, default=4, help="longest n-gram kept")
    p.add_argument("--min-count", type=int, default=4, help="keep n-grams seen at least this many times")
    p.set_defaults(run=_run_build_ngram)


def _run_build_ngram(args: argparse.Namespace) -> None:
    import time

    from specdraft.compat import tokenizer_fingerprint
    from specdraft.corpus import answers_from_jsonl
    from specdraft.drafters.ngram import build_table
    from specdraft.models.registry import load_tokenizer

    started = time.perf_counter()
    tokenizer = load_tokenizer(args.target)
    answers = [ids for _, ids in answers_from_jsonl(args.answers)]
    tokens = sum(map(len, answers))
    table = build_table(answers, args.max_order, args.min_count, {
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer), "target": args.target,
        "answers": len(answers), "answer_tokens": tokens})
    table.save(args.out)
    print(f"n-gram table {args.out}: {len(table.keys)} n-grams of 1 to {args.max_order} tokens from {len(answers)} "
          f"answers ({tokens} tokens) in {time.perf_counter() - started:.1f} s")


def _add_export(sub) -> None:
    from specdraft.export import FORMATS
    from specdraft.export.base import GGUF_TYPES

    p = sub.add_parser("export", help="export a drafter for another engine (transformers, llama.cpp, vLLM)")
    p.add_argument("drafter", help="drafter name (e.g. smollm2-135m-instruct-drafter) or checkpoint folder")
    p.add_argument("--format", required=True, choices=sorted(FORMATS), help="what to write")
    p.add_argument("--out", required=True, help="output folder (hf, speculators) or .gguf file (gguf)")
    p.add_argument("--target", help="target name or folder (default: the one the drafter names, else SmolLM2)")
    p.add_argument("--target-gguf", help="gguf: the target's GGUF file, whose tokenizer metadata is copied "
                                         "(default: the built-in target's)")
    p.add_argument("--gguf-type", choices=GGUF_TYPES,
                   help="gguf, eagle3-gguf, dflash-gguf: weight type of the matrices (default: q8_0 for gguf and "
                        "dflash-gguf, q4_0 for eagle3-gguf)")
    p.add_argument("--gguf-output-type", choices=GGUF_TYPES,
                   help="gguf, eagle3-gguf, dflash-gguf: weight type of the output matrix (dflash-gguf: and of "
                        "token_embd) (default: --gguf-type when given, else q4_0; q8_0 for dflash-gguf)")
    p.add_argument("--num-draft-tokens", type=int, default=4, help="speculators: γ, draft tokens per step")
    p.add_argument("--overwrite", action="store_true", help="replace an existing export once the new one is done")
    p.set_defaults(run=_run_export)


def _run_export(args: argparse.Namespace) -> None:
    from specdraft.export import ExportConfig, export

    out = export(ExportConfig(drafter=args.drafter, format=args.format, out=args.out, target=args.target,
                              target_gguf=args.target_gguf, gguf_type=args.gguf_type,
                              gguf_output_type=args.gguf_output_type,
                              num_draft_tokens=args.num_draft_tokens, overwrite=args.overwrite))
    print(f"exported {args.drafter} as {args.format} to {out}")


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server with batched speculative decoding")
    p.add_argument("--target", required=True, help="built-in name, checkpoint folder or cached hub id")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--draft", help="draft model: built-in name, checkpoint folder or cached hub id")
    how.add_argument("--drafter", choices=sorted(NAMED_DRAFTERS), help="a drafter by name (no draft model)")
    p.add_argument("--drafter-option", action="append", default=[], metavar="KEY=VALUE", help="drafter option")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    _add_precision(p, "float32")
    p.add_argument("--served-model-name", help="model id clients ask for (default: --target)")
    p.add_argument("--num-draft-tokens", type=int, default=4, help="γ, draft tokens per target forward")
    p.add_argument("--max-batch", type=int, default=8, help="sequences decoded together")
    p.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="a prompt reads the positions it shares with a running or finished sequence's KV cache, "
                        "where the target reads them exactly (GGUF blocks); answers are the same (default: on)")
    p.add_argument("--speculation", choices=SPECULATION, default="adaptive", help=SPECULATION_HELP)
    p.add_argument("--grammar-draft", action=argparse.BooleanOptionalAction, default=True,
                   help="propose the tokens a request's grammar forces (response_format, a required or named "
                        "tool_choice) as draft tokens, verified like any draft (default: on)")
    p.add_argument("--max-draft-batch", type=int, default=0,
                   help="draft only in steps with at most this many sequences, plain decoding above (0 = at every "
                        "batch size)")
    p.add_argument("--max-queue", type=int, default=64, help="waiting sequences; more answer 429")
    p.add_argument("--max-prompt-tokens", type=int, default=1024, help="longest prompt accepted")
    p.add_argument("--max-tokens", type=int, default=512, help="largest max_tokens a request may ask for")
    p.add_argument("--max-n", type=int, default=4, help="most completions per request")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body; larger answer 413")
    p.add_argument("--max-prompt-chars", type=int, default=0,
                   help="most prompt characters, checked before tokenising (0 = 32 x --max-prompt-tokens)")
    p.add_argument("--shutdown-grace", type=float, default=5.0,
                   help="seconds in-flight requests get after SIGTERM; the process exits within them")
    online = p.add_argument_group("online distillation (Online Speculative Decoding, Liu et al. 2023)")
    online.add_argument("--online-distill", metavar="DIR",
                        help="keep training the draft model on the served traffic; buffer and drafter saved in DIR")
    online.add_argument("--online-loss", choices=ONLINE_LOSSES, default="fkl", help="distillation loss")
    online.add_argument("--online-loss-option", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting of the loss (e.g. alpha=0.2 for skl)")
    online.add_argument("--online-every-tokens", type=int, default=2048, help="a training round every N served tokens")
    online.add_argument("--online-steps", type=int, default=32, help="optimizer steps per round")
    online.add_argument("--online-lr", type=float, default=1e-4, help="learning rate")
    online.add_argument("--online-max-records", type=int, default=512, help="replay buffer size in sequences")
    online.add_argument("--online-nice", type=int, default=19, help="CPU niceness of the training thread, 0-19")
    p.set_defaults(run=_run_serve)


def _run_serve(args: argparse.Namespace) -> None:
    import importlib.util

    missing = [name for name in ("fastapi", "uvicorn") if importlib.util.find_spec(name) is None]
    if missing:
        raise SpecdraftError(f"serve needs {' and '.join(missing)}: pip install 'specdraft[serve]'")
    from specdraft.serve import ServeConfig, run_server

    options = tuple(parse_options(args.drafter_option).items())
    run_server(ServeConfig(
        target=args.target, draft=args.draft, drafter=args.drafter, drafter_options=options, dtype=args.dtype,
        quantize=args.quantize,
        served_model_name=args.served_model_name, num_draft_tokens=args.num_draft_tokens, max_batch=args.max_batch,
        prefix_cache=args.prefix_cache, speculation=args.speculation, max_draft_batch=args.max_draft_batch,
        grammar_draft=args.grammar_draft,
        max_queue=args.max_queue, max_prompt_tokens=args.max_prompt_tokens, max_tokens=args.max_tokens,
        max_n=args.max_n, max_body_bytes=args.max_body_bytes, max_prompt_chars=args.max_prompt_chars,
        shutdown_grace=args.shutdown_grace, host=args.host, port=args.port, online_distill=_online_config(args),
    ))


def _online_config(args: argparse.Namespace):
    if not args.online_distill:
        return None
    from specdraft.serve.online_config import OnlineDistillConfig

    return OnlineDistillConfig(folder=args.online_distill, loss=args.online_loss, every_tokens=args.online_every_tokens,
                               steps=args.online_steps, lr=args.online_lr, max_records=args.online_max_records,
                               nice=args.online_nice,
                               loss_options=tuple(parse_options(args.online_loss_option).items()))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdraft", description="Lossless speculative decoding for chat LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_demo(sub)
    _add_bench(sub)
    _add_calibrate(sub)
    _add_build_datastore(sub)
    _add_build_ngram(sub)
    _add_export(sub)
    _add_serve(sub)
    add_training_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    message = _run(args)
    if message is None:
        return 0
    gc.collect()  # progress bars the failed command left open are closed (their line ended) before the error line
    print(f"specdraft: error: {message}", file=sys.stderr, flush=True)
    return 2


def _run(args: argparse.Namespace) -> str | None:
    """Run the subcommand; the one line describing the user's error that stopped it, or None."""
    if getattr(args, "kv_cache", "auto") != "auto":
        from specdraft.models.quantized_llama import KV_CACHE_ENV

        os.environ[KV_CACHE_ENV] = args.kv_cache  # read where quantized models are built (and by engine processes)
    try:
        args.run(args)
    except SpecdraftError as exc:
        return str(exc)
    except OSError as exc:  # unreadable input, unwritable output, a full disk: the environment's, not a bug
        return os_error(exc)
    except UnicodeDecodeError as exc:  # a file read where its name was not at hand (named ones are SpecdraftErrors)
        return f"a file read is {utf8_error(exc)}: {exc.reason}"
    return None


if __name__ == "__main__":
    sys.exit(main())
