"""A draft model as the speculative proposer: any smaller model with the target's vocabulary.

The draft keeps its own paged KV cache and a sequence per request. Before proposing, it computes
(prefill, in chunks) whatever the target has accepted since its last proposal; then it decodes K
tokens for all proposing requests together, greedily for greedy requests and by sampling (with the
request's generator, keeping each q for rejection sampling) otherwise. After verification its KV
length is cut back to what the target kept, so rejected guesses are simply overwritten next time.
"""
from __future__ import annotations

import torch

from slipstream.engine.request import Request
from slipstream.engine.sampling import _draw, sampling_distribution
from slipstream.kv.blocks import OutOfBlocks, SequenceKV
from slipstream.models.llama import SeqSlice, StepInput
from slipstream.weights.quant import matvec_only

PREFILL_CHUNK = 512


class DraftModelProposer:
    name = "draft"

    def __init__(self, model, k: int, kv_tokens: int = 16384, block_size: int = 16):
        from slipstream.runtime.cpu_native import NativeDecoder

        self.model = model
        self.k = k
        self.kv = model.new_kv_cache(-(-kv_tokens // block_size), block_size)
        self.runtime = NativeDecoder(model, self.kv) if NativeDecoder.supports(model) else None
        self.seqs: dict[str, SequenceKV] = {}

    def _catch_up(self, r: Request, seq: SequenceKV) -> None:
        """Compute the draft's KV for every token the target has accepted but the draft has not seen."""
        ids, target = r.all_token_ids, r.num_tokens - 1
        while seq.num_tokens < target:
            start = seq.num_tokens
            end = min(target, start + PREFILL_CHUNK)
            seq.reserve(end)
            step = StepInput(torch.tensor(ids[start:end]), torch.arange(start, end), seq.slots(start, end),
                             [SeqSlice(0, end - start, end, seq.read_slots(end))], torch.tensor([end - start - 1]))
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
            tokens, positions, slots, seqs = [], [], [], []
            for row, (i, r, seq) in enumerate(rows):
                pos = r.num_tokens - 1 + j
                tokens.append(last[i])
                positions.append(pos)
                slots.append(seq.slots(pos, pos + 1))
                seqs.append(SeqSlice(row, 1, pos + 1, seq.read_slots(pos + 1)))
            step = StepInput(torch.tensor(tokens), torch.tensor(positions), torch.cat(slots), seqs,
                             torch.arange(len(rows)))
            with matvec_only():
                logits = self.runtime.forward(step) if self.runtime is not None else self.model.forward(step, self.kv)
            for row, (i, r, seq) in enumerate(rows):
                seq.num_tokens = r.num_tokens + j
                if r.params.greedy:
                    d = int(logits[row].argmax())
                else:
                    q = sampling_distribution(logits[row].float(), r.params)
                    d = _draw(q, r.generator)
                    qs[i].append(q)          # type: ignore[union-attr]
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
