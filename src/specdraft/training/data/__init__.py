"""Distillation data: making it (``distill-data``: :mod:`.distill_data` with its engines, prompt sources and
on-policy answers; ``distill-topk``: :mod:`.distill_topk`; ``task-prompts``: :mod:`.task_prompts`) and reading it
(:mod:`.records`, :mod:`.batches`). Imports only :mod:`specdraft.training.runs.folders` of training."""
