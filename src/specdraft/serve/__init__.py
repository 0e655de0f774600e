"""``specdraft serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) that decodes many requests together,
speculatively, with continuous batching (:mod:`specdraft.batching`). Needs the ``serve`` extra."""

from __future__ import annotations

import logging
import socket

from specdraft.errors import SpecdraftError
from specdraft.serve.config import ServeConfig
from specdraft.serve.online_config import OnlineDistillConfig

log = logging.getLogger(__name__)


def build_server_app(config: ServeConfig):
    """Load the target and drafter named by ``config`` and build the app (not yet serving)."""
    from specdraft.batch_drafting import lockstep_factory
    from specdraft.batching import drafter_factory
    from specdraft.costs import cost_curve
    from specdraft.drafters.registry import load_drafter
    from specdraft.models.registry import choose_precision, eos_token_ids, load_target
    from specdraft.serve.app import build_app
    from specdraft.serve.engine import Engine
    from specdraft.step import STEP_ROOM

    precision = choose_precision(config.target, config.dtype, config.quantize)
    target, tokenizer = load_target(config.target, precision.dtype, quantize=precision.quantize)
    prototype = load_drafter(target, tokenizer, config.draft, config.drafter, precision.draft_dtype,
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
    if config.speculation == "adaptive":
        cost_curve(target, log=lambda line: log.info("%s", line))  # measured (or read) before serving, not on a request
    engine = Engine(target, tokenizer, make, config.max_batch, capacity, config.max_queue, online, config.prefix_cache)
    return build_app(engine, tokenizer, config, eos_token_ids(tokenizer, config.target))


def run_server(config: ServeConfig) -> None:
    """Serve until SIGTERM or SIGINT, then shut down gracefully (:mod:`specdraft.serve.shutdown`): in-flight
    requests get ``config.shutdown_grace`` seconds, the process exits within them.

    Settings are checked before any model loads: the port is bound first (a port in use is a clear error), and an
    ``--online-distill`` folder must be usable, its files intact."""
    import uvicorn

    from specdraft.serve.shutdown import GracefulServer

    listener = bind(config.host, config.port)
    try:
        if config.online_distill is not None:
            from specdraft.serve.online import check_folder

            check_folder(config.online_distill, config.draft)
        app = build_server_app(config)
        settings = uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=1)
        GracefulServer(settings, app.state.drain).run(sockets=[listener])
    finally:
        listener.close()


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port), not yet listening (uvicorn listens once the app is ready)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        listener = socket.socket(family, kind, proto)
    except OSError as exc:
        raise SpecdraftError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a port in TIME_WAIT is free
        listener.bind(address)
    except OSError as exc:
        listener.close()
        raise SpecdraftError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return listener


__all__ = ["OnlineDistillConfig", "ServeConfig", "bind", "build_server_app", "run_server"]
