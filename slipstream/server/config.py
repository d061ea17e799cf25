"""The server's own settings (limits, security, connection hygiene) as one frozen, validated value.

The engine's settings (batch size, queue length, KV cache, prefill budget) live with the engine;
these are the HTTP side's. `slipstream serve` builds one from its flags; `build_app` and
`run_server` take it whole.
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from slipstream.errors import SlipstreamError

MiB = 1024 * 1024


@dataclass(frozen=True)
class ServerConfig:
    # -- security ---------------------------------------------------------------------------------
    api_key: str | None = None               # None: the API is open to whoever reaches the address
    allowed_hosts: tuple[str, ...] | None = None   # Host header names accepted (None: no check; "*": any)
    cors_origins: tuple[str, ...] = ()       # no CORS headers unless origins are given
    served_model_name: str | None = None
    # -- limits on one request ----------------------------------------------------------------------
    max_body_bytes: int = 4 * MiB            # 413 past it (before the body is read)
    max_json_depth: int = 32                 # nesting of the JSON body
    max_prompt_chars: int | None = None      # per prompt / per chat conversation; None: 32 x context
    max_stop_sequences: int = 4
    max_stop_chars: int = 256                # per stop string
    max_choices: int = 128                   # n x prompts of one request
    # -- CPU work off the event loop -------------------------------------------------------------
    workers: int = 2                         # threads tokenizing / rendering templates
    max_queued_jobs: int = 512               # jobs waiting for a worker; past it: 503 + Retry-After
    # -- connections ----------------------------------------------------------------------------
    header_timeout: float = 10.0             # seconds to send a request's headers
    body_timeout: float = 30.0               # seconds to send a request's body
    idle_timeout: float = 5.0                # keep-alive: seconds between requests
    max_connections: int = 1024              # open connections; past it new ones get 503 and are closed
    drain_timeout: float | None = None       # SIGTERM: seconds in-flight requests may still run
    retry_after_s: int = 1                   # the Retry-After of a 503
    # -- tools and reasoning ------------------------------------------------------------------------
    tool_parser: str | None = None           # None: picked from the chat template (hermes when it has none)
    reasoning_parser: str | None = None      # None: "think" when the template uses <think>; "think" | "none"

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise SlipstreamError("the API key is empty: give a non-empty --api-key / SLIPSTREAM_API_KEY, "
                                  "or neither to serve an open API")
        for name in ("max_body_bytes", "max_json_depth", "max_stop_sequences", "max_stop_chars", "max_choices",
                     "workers", "max_queued_jobs", "max_connections", "retry_after_s"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise SlipstreamError(f"{name.replace('_', '-')} must be an integer >= 1, got {v!r}")
        if self.max_prompt_chars is not None and self.max_prompt_chars < 1:
            raise SlipstreamError(f"max-prompt-chars must be >= 1, got {self.max_prompt_chars}")
        for name in ("header_timeout", "body_timeout", "idle_timeout"):
            if not getattr(self, name) > 0:
                raise SlipstreamError(f"{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if self.reasoning_parser not in (None, "think", "none"):
            raise SlipstreamError(f"reasoning-parser must be 'think' or 'none', got {self.reasoning_parser!r}")
        if self.tool_parser is not None:
            from slipstream.structured.tool_parsers import PARSERS
            if self.tool_parser not in PARSERS:
                raise SlipstreamError(f"unknown tool parser {self.tool_parser!r} ({', '.join(PARSERS)})")
        if self.drain_timeout is not None and self.drain_timeout < 0:
            raise SlipstreamError(f"drain-timeout must be >= 0, got {self.drain_timeout}")

    def prompt_chars(self, context: int) -> int:
        return self.max_prompt_chars if self.max_prompt_chars is not None else 32 * context


def default_allowed_hosts(bound: str, extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Host names a request may name when the server is bound to `bound` (DNS-rebinding guard):
    the bound address itself, `localhost` and the loopback literals when bound to loopback, any IP
    literal when bound to every interface (an IP cannot be rebound), plus `extra` ("*": anything)."""
    hosts = {bound.strip("[]").lower()}
    try:
        ip = ipaddress.ip_address(bound.strip("[]"))
    except ValueError:
        ip = None
    if bound.lower() == "localhost" or (ip is not None and (ip.is_loopback or ip.is_unspecified)):
        hosts |= {"localhost", "127.0.0.1", "::1"}
    if ip is not None and ip.is_unspecified:
        hosts.add("<ip>")
    hosts |= {h.strip().lower() for h in extra if h.strip()}
    return tuple(sorted(hosts))


def host_allowed(host_header: str, allowed: tuple[str, ...]) -> bool:
    if "*" in allowed:
        return True
    h = host_header.strip().lower()
    if h.startswith("["):                      # [v6]:port
        name = h[1:h.find("]")] if "]" in h else h[1:]
    else:
        name = h.rsplit(":", 1)[0] if h.count(":") == 1 else h
    if name in allowed:
        return True
    if "<ip>" in allowed:
        try:
            ipaddress.ip_address(name)
            return True
        except ValueError:
            return False
    return False
