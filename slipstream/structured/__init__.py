"""Structured output, tool calling and reasoning content.

    constraint.py   what a request asks its output to match (JSON schema, JSON object, regex, choice,
                    grammar), as one frozen value that is part of SamplingParams (and so of the merge key)
    grammar.py      the constraint compiled for a tokenizer (llguidance) and a per-request matcher
    masks.py        token bitmasks for a batch, applied to logits; optionally filled while the model runs
    tool_parsers.py tool calls out of model text: Hermes/Qwen, Llama 3.x JSON, Mistral, DeepSeek-V3, GLM-4.5
    tool_schema.py  tool definitions checked, and the constraint for tool_choice required / named
    reasoning.py    <think>...</think> split from the answer, whole or streamed
    chat_output.py  one choice's text turned into content / reasoning / tool-call deltas (streamed or not)
"""
