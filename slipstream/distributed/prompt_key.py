"""A request body -> the router's `PromptKey`: its prompt tokenized as the replica's server will
tokenize it (`server.routes.prepare_chat` / `prepare_completion`: the chat template with the
generation prompt and no added special tokens; a completion prompt with them), then hashed block by
block with `kv.prefix_cache.block_hash`, the engine's own chained hash.

Best effort: a body that does not parse, or a prompt the tokenizer cannot take, has no key (the
router sends it to the least loaded replica, whose server then answers with the proper error).
"""
from __future__ import annotations

import json
from typing import Any, Sequence

from slipstream.distributed.router import PromptKey
from slipstream.kv.prefix_cache import block_hash

CHAT_PATH = "/v1/chat/completions"
COMPLETION_PATH = "/v1/completions"
ROUTED_PATHS = (CHAT_PATH, COMPLETION_PATH)


def key_of_tokens(ids: Sequence[int], block_size: int) -> PromptKey:
    """The chained hashes of the full blocks of `ids`, and a hash of all of `ids`."""
    blocks: list[int] = []
    parent: int | None = None
    full = len(ids) // block_size
    for i in range(full):
        parent = block_hash(parent, ids[i * block_size:(i + 1) * block_size])
        blocks.append(parent)
    return PromptKey(tuple(blocks), block_hash(parent, ids[full * block_size:]) ^ len(ids))


def prompt_ids(path: str, body: bytes, tokenizer: Any, max_chars: int) -> list[int] | None:
    """The token ids of the (first) prompt of a chat or completion request body, or None."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict):
        return None
    try:
        if path == CHAT_PATH:
            from slipstream.server.protocol import ChatCompletionRequest

            req = ChatCompletionRequest.model_validate(data)
            msgs = [m.as_template_message() for m in req.messages]
            if sum(len(m["content"]) for m in msgs) > max_chars:
                return None
            text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
            return list(tokenizer.encode(text, add_special_tokens=False))
        if path == COMPLETION_PATH:
            from slipstream.server.protocol import CompletionRequest

            creq = CompletionRequest.model_validate(data)
            first = creq.prompts()[0]
            if isinstance(first, str):
                if len(first) > max_chars:
                    return None
                return list(tokenizer.encode(first, add_special_tokens=True))
            return [int(t) for t in first]
    except Exception:   # any invalid request: the replica's server says what is wrong with it
        return None
    return None


def prompt_key(path: str, body: bytes, tokenizer: Any, block_size: int, max_chars: int) -> PromptKey | None:
    ids = prompt_ids(path, body, tokenizer, max_chars)
    return None if not ids else key_of_tokens(ids, block_size)
