"""The OpenAI-compatible HTTP server (`slipstream serve`).

Nothing here is imported by `slipstream`, `slipstream.engine` or `slipstream.api`: the server's
dependencies (fastapi, uvicorn, prometheus-client) are needed only to serve.

    config.py        ServerConfig: limits, security, connection hygiene (one frozen value)
    protocol.py      request models and their validation, OpenAI-shaped errors and their codes
    http.py          the request guard (request id, Host, API key, body limits) and connection protocol
    state.py         AppState (what every route reads), the worker pool, shared checks
    routes.py        one function per route: `async def route(S, request)`
    streaming.py     the one SSE path of chat and completions
    openapi.py       the served OpenAPI document and /docs
    async_engine.py  the engine on its own thread (typed messages in); per-request async streams out
    metrics.py       Prometheus metrics (one registry per app)
    app.py           the app (`build_app`) and `run_server` (graceful drain)
"""
