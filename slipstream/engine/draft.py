"""A draft model as the speculative proposer: any smaller model with the target's vocabulary.

The draft keeps its own paged KV cache and a sequence per request. Before proposing, it computes
(prefill, in chunks) whatever the target has accepted since its last proposal; then it decodes K
tokens for all proposing requests together, greedily for greedy requests and by sampling (with the
request's generator, keeping each q for rejection sampling) otherwise. After verification its KV
length is cut back to what the target kept, so rejected guesses are simply overwritten next time.
"""
from __future__ import annotations

from slipstream.engine.request import Request
from slipstream.engine.sampling import draw, sampling_distribution
from slipstream.kv.blocks import OutOfBlocks, SequenceKV
from slipstream.step import StepBuilder, prefill_step
from slipstream.weights.quant import matvec_only

PREFILL_CHUNK = 512


class DraftModelProposer:
    name = "draft"

    def __init__(self, model, k: int, kv_tokens: int = 16384, block_size: int = 16):
        from slipstream.runtime.registry import build_decoder, kv_cache_dtype, new_kv_cache, unsupported

        self.model = model
        self.k = k
        name = "native" if unsupported("native", model) is None else "eager"
        # the draft's cache as the target's would be under its runtime (fp16 on the native fast path): its
        # guesses are checked by the target, so only their acceptance could change, never the output
        self.kv = new_kv_cache(model, -(-kv_tokens // block_size), block_size, kv_cache_dtype("auto", name, model))
        self.runtime = build_decoder(name, model, self.kv)
        self.seqs: dict[str, SequenceKV] = {}

    def _catch_up(self, r: Request, seq: SequenceKV) -> None:
        """Compute the draft's KV for every token the target has accepted but the draft has not seen."""
        ids, target = r.all_token_ids, r.num_tokens - 1
        while seq.num_tokens < target:
            start = seq.num_tokens
            end = min(target, start + PREFILL_CHUNK)
            seq.reserve(end)
            step = prefill_step(seq, ids[start:end], start)
            self.model.forward(step, self.kv)
            seq.num_tokens = end

    def propose_batch(self, reqs: list[Request], ks: list[int]) -> tuple[list[list[int]], list[list | None]]:
        drafts: list[list[int]] = [[] for _ in reqs]
        qs: list[list | None] = [None if r.params.greedy else [] for r in reqs]
        active = []
        for i, (r, k) in enumerate(zip(reqs, ks)):
            if k <= 0:
                continue
            seq = self.seqs.setdefault(r.request_id, SequenceKV(self.kv))
            try:
                self._catch_up(r, seq)
                seq.reserve(r.num_tokens - 1 + k)
            except OutOfBlocks:      # the draft's cache is full: this request decodes plainly
                continue
            active.append((i, r, k, seq))
        last = {i: r.output_ids[-1] for i, r, _, _ in active}
        for j in range(max((k for _, _, k, _ in active), default=0)):
            rows = [(i, r, seq) for i, r, k, seq in active if k > j]
            b = StepBuilder()
            for i, r, seq in rows:
                b.add(seq, [last[i]], r.num_tokens - 1 + j)
            step = b.build()
            with matvec_only():
                logits = self.runtime.forward(step)
            for row, (i, r, seq) in enumerate(rows):
                seq.num_tokens = r.num_tokens + j
                if r.params.greedy:
                    d = int(logits[row].argmax())
                else:
                    q = sampling_distribution(logits[row].float(), r.params)
                    d = draw(q, r.generator)
                    qs[i].append(q)
                drafts[i].append(d)
                last[i] = d
        return drafts, qs

    def verified(self, r: Request) -> None:
        seq = self.seqs.get(r.request_id)
        if seq is not None:   # the draft's KV is valid as far as the target kept its tokens
            seq.num_tokens = min(seq.num_tokens, r.num_tokens - 1)

    def release(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            seq.release()
