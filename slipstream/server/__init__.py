"""The OpenAI-compatible HTTP server (`slipstream serve`).

Nothing here is imported by `slipstream`, `slipstream.engine` or `slipstream.api`: the server's
dependencies (fastapi, uvicorn, prometheus-client) are needed only to serve.

    protocol.py      request models and their validation, OpenAI-shaped errors
    async_engine.py  the engine on its own thread; per-request async streams of its events
    metrics.py       Prometheus metrics (one registry per app)
    app.py           the FastAPI app (`build_app`) and `run_server`
"""
