"""``specdraft serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) that decodes many requests together,
speculatively, with continuous batching (:mod:`specdraft.batching`). Needs the ``serve`` extra."""

from __future__ import annotations

from specdraft.serve.config import ServeConfig
from specdraft.serve.online_config import OnlineDistillConfig


def build_server_app(config: ServeConfig):
    """Load the target and drafter named by ``config`` and build the app (not yet serving)."""
    from specdraft.batch_drafting import lockstep_factory
    from specdraft.batching import DraftGate, drafter_factory
    from specdraft.drafters.loading import load_drafter
    from specdraft.models.registry import eos_token_ids, load_target, parse_dtype
    from specdraft.serve.app import build_app
    from specdraft.serve.engine import Engine
    from specdraft.step import STEP_ROOM

    dtype = parse_dtype(config.dtype)
    target, tokenizer = load_target(config.target, dtype)
    prototype = load_drafter(target, tokenizer, config.draft, config.drafter, dtype,
                             options=dict(config.drafter_options))
    capacity = config.max_prompt_tokens + config.max_tokens

    def factory(drafter):
        return lockstep_factory(drafter, 2 * config.max_batch + 2, capacity + STEP_ROOM, drafter_factory(drafter))

    online = None
    if config.online_distill is not None:
        from specdraft.serve.online import OnlineDistiller

        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        online = OnlineDistiller(config.online_distill, prototype, config.draft, factory, pad_id)
    make = online.make_drafter if online is not None else factory(prototype)
    gate = DraftGate() if config.batch_speculation == "adaptive" else None
    engine = Engine(target, tokenizer, make, config.max_batch, capacity, config.max_queue, config.max_draft_batch,
                    online, gate)
    return build_app(engine, tokenizer, config, eos_token_ids(tokenizer, config.target))


def run_server(config: ServeConfig) -> None:
    """Serve until SIGTERM or SIGINT; in-flight requests get a few seconds to finish, then the engine stops."""
    import uvicorn

    app = build_server_app(config)
    uvicorn.run(app, host=config.host, port=config.port, log_level="info", timeout_graceful_shutdown=5)


__all__ = ["OnlineDistillConfig", "ServeConfig", "build_server_app", "run_server"]
