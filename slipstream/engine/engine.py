"""The generation loop: admit requests, prefill them in chunks, decode them together, stream text.

This is the engine in its first form: requests given up front are admitted while KV blocks and
batch slots allow (each reserves the blocks its prompt + max_tokens can fill, so a running request
never runs out), prefilled one by one in chunks, then decoded as one batch per step. Every step
yields what each request produced, so callers can stream.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from slipstream.engine.request import Request
from slipstream.engine.sampling import Sampler, make_generator
from slipstream.errors import PromptTooLongError, SlipstreamError
from slipstream.kv.blocks import SequenceKV
from slipstream.models.llama import LlamaModel, SeqSlice, StepInput

KV_BUDGET_BYTES = 1 << 30


@dataclass
class StepEvent:
    request: Request
    text: str              # newly final text (stop strings are never part of it)
    token_ids: list[int]   # tokens sampled this step


class Engine:
    def __init__(self, model: LlamaModel, tokenizer, max_model_len: int | None = None,
                 kv_cache_tokens: int | None = None, block_size: int = 16, max_batch: int = 8,
                 prefill_chunk: int = 512, runtime: str = "auto"):
        self.model = model
        self.tokenizer = tokenizer
        cfg = model.cfg
        if max_model_len is not None and (not isinstance(max_model_len, int) or max_model_len < 2):
            raise SlipstreamError(f"max_model_len must be an integer >= 2, got {max_model_len!r}")
        self.max_model_len = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
        if kv_cache_tokens is None:
            kv_cache_tokens = max(self.max_model_len, min(2 * self.max_model_len, KV_BUDGET_BYTES // per_token))
        self.kv = model.new_kv_cache(-(-kv_cache_tokens // block_size), block_size)
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.sampler = Sampler()
        self.runtime = self._pick_runtime(runtime)

    def _pick_runtime(self, runtime: str):
        """The decode step's executor: the native CPU step where it applies, else eager torch."""
        from slipstream.runtime.cpu_native import NativeDecoder

        if runtime not in ("auto", "eager", "native"):
            raise ValueError(f"unknown runtime {runtime!r} (auto, eager, native)")
        supported = NativeDecoder.supports(self.model)
        if runtime == "native" and not supported:
            raise SlipstreamError("the native runtime needs packed GGUF weights (Q4_0/Q4_1/Q8_0/Q4_K) "
                                  "without q/k/v biases, and the native kernels; use --runtime auto or eager")
        if runtime == "eager" or not supported:
            return None
        return NativeDecoder(self.model, self.kv)

    @property
    def runtime_name(self) -> str:
        return "eager" if self.runtime is None else "native"

    # -- admission ------------------------------------------------------------------------------
    def check_prompt(self, ids: list[int]) -> None:
        n_prompt = len(ids)
        if n_prompt == 0:
            raise SlipstreamError("the prompt is empty")
        vocab = self.model.cfg.vocab_size
        bad = next((t for t in ids if not (isinstance(t, int) and 0 <= t < vocab)), None)
        if bad is not None:
            raise SlipstreamError(f"prompt token id {bad!r} is outside the vocabulary (0..{vocab - 1})")
        need = -(-min(n_prompt + 1, self.max_model_len) // self.kv.block_size)
        if need > self.kv.num_blocks:
            raise SlipstreamError(f"the KV cache holds {self.kv.capacity_tokens} tokens, too few for a "
                                  f"prompt of {n_prompt}")
        if n_prompt >= self.max_model_len:
            raise PromptTooLongError(f"the prompt has {n_prompt} tokens but the context length is "
                                     f"{self.max_model_len} (room is needed for at least one new token)")

    def _budget(self, r: Request) -> int:
        return min(len(r.prompt_ids) + r.params.max_tokens, self.max_model_len)

    def _try_admit(self, r: Request) -> bool:
        need = -(-self._budget(r) // self.kv.block_size)
        if need > self.kv.allocator.num_free:
            return False
        r.kv = SequenceKV(self.kv)
        r.kv.reserve(self._budget(r))
        r.generator = make_generator(r.params.seed)
        r.detok = self.tokenizer.detokenizer()
        return True

    # -- steps ----------------------------------------------------------------------------------
    def _prefill(self, r: Request) -> torch.Tensor:
        ids = r.prompt_ids
        logits = None
        for start in range(0, len(ids), self.prefill_chunk):
            end = min(start + self.prefill_chunk, len(ids))
            n = end - start
            step = StepInput(torch.tensor(ids[start:end]), torch.arange(start, end),
                             r.kv.slots(start, end), [self._seq_slice(r, 0, n, end)],
                             torch.tensor([n - 1]))
            logits = self.model.forward(step, self.kv)
        r.kv.num_tokens = len(ids)
        return logits

    def _seq_slice(self, r: Request, row: int, n: int, context: int) -> SeqSlice:
        rng = r.kv.contiguous_range(context)
        return SeqSlice(row, n, context, rng if rng is not None else r.kv.slots(0, context))

    def _decode(self, batch: list[Request]) -> torch.Tensor:
        tokens, positions, slots, seqs = [], [], [], []
        for i, r in enumerate(batch):
            pos = r.num_tokens - 1   # the last sampled token is not in the cache yet
            tokens.append(r.output_ids[-1])
            positions.append(pos)
            slots.append(r.kv.slots(pos, pos + 1))
            seqs.append(self._seq_slice(r, i, 1, pos + 1))
        step = StepInput(torch.tensor(tokens), torch.tensor(positions), torch.cat(slots), seqs,
                         torch.arange(len(batch)))
        logits = self.model.forward(step, self.kv) if self.runtime is None else self.runtime.forward(step)
        for r in batch:
            r.kv.num_tokens += 1
        return logits

    def _sample(self, batch: list[Request], logits: torch.Tensor) -> list[StepEvent]:
        res = self.sampler(logits, [r.params for r in batch], [r.prompt_ids for r in batch],
                           [r.output_ids for r in batch], [r.generator for r in batch])
        now = time.perf_counter()
        return [self._append(r, t, lp, now) for r, t, lp in zip(batch, res.token_ids, res.logprobs)]

    def _append(self, r: Request, tok: int, lp, now: float) -> StepEvent:
        p = r.params
        if r.metrics.first_token is None:
            r.metrics.first_token = now
        r.output_ids.append(tok)
        r.metrics.num_output_tokens += 1
        if lp is not None:
            r.logprobs.append(lp)
        if (tok in self.tokenizer.eos_token_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            r.finish_reason = "stop"
        else:
            before = len(r.text)
            r.text += r.detok.add(tok)
            self._check_stop_strings(r, before)
        if r.finish_reason is None and (len(r.output_ids) >= p.max_tokens or r.num_tokens >= self.max_model_len):
            r.finish_reason = "length"
        if r.finished:
            if r.finish_reason == "length":
                before = len(r.text)
                r.text += r.detok.flush()
                self._check_stop_strings(r, before)
            r.metrics.finished = now
        end = len(r.text) if r.finished else len(r.text) - self._held_back(r)
        delta = r.text[r.emitted:end] if end > r.emitted else ""
        r.emitted = max(r.emitted, end)
        return StepEvent(r, delta, [tok])

    @staticmethod
    def _check_stop_strings(r: Request, before: int) -> None:
        for s in r.params.stop:
            i = r.text.find(s, max(0, before - len(s) + 1))
            if i >= 0:
                r.text = r.text[:i]
                r.finish_reason = "stop"
                before = min(before, i)

    @staticmethod
    def _held_back(r: Request) -> int:
        """Length of the text's tail that could still become a stop string: not streamed yet."""
        held = 0
        for s in r.params.stop:
            for k in range(min(len(s) - 1, len(r.text)), held, -1):
                if r.text.endswith(s[:k]):
                    held = k
                    break
        return held

    def _release(self, r: Request) -> None:
        if r.kv is not None:
            r.kv.release()
            r.kv = None

    # -- the loop -------------------------------------------------------------------------------
    def run(self, requests: Iterable[Request]) -> Iterator[list[StepEvent]]:
        """Generate for all requests; yields each step's events until every request is finished."""
        waiting = deque(requests)
        for r in waiting:
            self.check_prompt(r.prompt_ids)
        running: list[Request] = []
        try:
            while waiting or running:
                events: list[StepEvent] = []
                while waiting and len(running) < self.max_batch and self._try_admit(waiting[0]):
                    r = waiting.popleft()
                    if r.params.max_tokens == 0:
                        r.finish_reason = "length"
                        r.metrics.finished = time.perf_counter()
                        self._release(r)
                        events.append(StepEvent(r, "", []))
                        continue
                    running.append(r)   # before prefill: if it raises, `finally` frees the blocks
                    events += self._sample([r], self._prefill(r))
                if not running and waiting:
                    r = waiting[0]
                    raise SlipstreamError(f"the KV cache holds {self.kv.capacity_tokens} tokens, too few for "
                                          f"a request of {self._budget(r)} (prompt + max_tokens)")
                decoding = [r for r in running if not r.finished]
                if decoding and not events:
                    events += self._sample(decoding, self._decode(decoding))
                for r in [r for r in running if r.finished]:
                    self._release(r)
                    running.remove(r)
                yield events
        finally:  # a caller that stops iterating (a closed stream) gives its blocks back
            for r in running:
                self._release(r)
