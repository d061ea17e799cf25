"""Multi-token prediction (MTP) layers as the speculative proposer (DeepSeek-V3 / GLM family).

An MTP layer at position i takes the main model's final hidden state h_i and the next token
t_{i+1} and predicts t_{i+2}; it has its own KV (cache layers after the main ones, on the same
slots). So that its attention sees every earlier position, the layer runs over each position the
target has computed and accepted (`observe`, fed with the target's hidden states from prefill,
decode and verification steps). Its output at the newest position gives the first guess; further
guesses chain the layer on its own output (position P, P+1, ...), the way DeepSeek's paper and vLLM
chain a single MTP module. Those chained positions write provisional MTP KV that is overwritten
once the target has decided. Guesses are argmax for greedy requests, sampled (with q kept for
rejection sampling) otherwise; whatever they are, the target's verification keeps output exact.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from slipstream.engine.request import Request
from slipstream.engine.sampling import draw, sampling_distribution
from slipstream.step import prefill_step


@dataclass
class _State:
    done: int = 0                                              # MTP KV valid for positions [0, done)
    pending: dict[int, torch.Tensor] = field(default_factory=dict)   # position -> target hidden [D]
    logits: torch.Tensor | None = None                         # MTP logits at position done - 1
    x: torch.Tensor | None = None                              # MTP output there (the chain's input)


class MTPProposer:
    name = "mtp"
    needs_hidden = True

    def __init__(self, model, k: int):
        if not getattr(model, "mtp", None):
            raise ValueError("--speculative mtp needs a model with MTP layers (num_nextn_predict_layers > 0 "
                             "and their weights in the checkpoint)")
        self.model, self.k = model, k
        self.kv = None            # the engine's cache, set by the engine
        self.state: dict[str, _State] = {}

    # -- following the target -------------------------------------------------------------------
    def observe(self, r: Request, start: int, hidden: torch.Tensor) -> None:
        """The target computed (and kept) positions [start, start + len(hidden)) with these
        final hidden states."""
        st = self.state.get(r.request_id)
        if st is None:   # a new sequence: positions before `start` came from the prefix cache
            st = self.state[r.request_id] = _State(done=start)
        if start < st.done:      # recomputed after a preemption: the MTP KV went with the blocks
            st.done, st.logits, st.x = start, None, None
            st.pending.clear()
        for j in range(hidden.shape[0]):
            st.pending[start + j] = hidden[j]
        self._advance(r, st)

    def _advance(self, r: Request, st: _State) -> None:
        """Run the MTP layer over every pending position whose next token is known."""
        ids = r.all_token_ids
        end = st.done
        while end in st.pending and end + 1 < len(ids):
            end += 1
        if end == st.done:
            return
        hid = torch.stack([st.pending.pop(i) for i in range(st.done, end)])
        step = prefill_step(r.seq, ids[st.done + 1:end + 1], st.done, gather=True)
        logits, x = self.model.mtp_forward(step, self.kv, hid, 0)
        st.done, st.logits, st.x = end, logits[0], x[-1]

    # -- proposing ------------------------------------------------------------------------------
    def propose_batch(self, reqs: list[Request], ks: list[int]) -> tuple[list[list[int]], list[list | None]]:
        drafts: list[list[int]] = []
        qs: list[list | None] = []
        for r, k in zip(reqs, ks):
            d, q = self._propose(r, k) if k > 0 else ([], None)
            drafts.append(d)
            qs.append(q)
        return drafts, qs

    def _pick(self, r: Request, logits: torch.Tensor, q: list | None) -> int:
        if r.params.greedy:
            return int(logits.argmax())
        p = sampling_distribution(logits.float(), r.params)
        q.append(p)
        return draw(p, None)       # never the request's generator: seeded output must not change

    def _propose(self, r: Request, k: int) -> tuple[list[int], list | None]:
        st = self.state.get(r.request_id)
        if st is None:
            return [], None
        self._advance(r, st)
        P = r.num_tokens - 1                     # the target's KV holds [0, P); x_P is the newest token
        if st.done != P or st.logits is None or st.x is None:    # out of step (e.g. plain decode steps without hidden)
            return [], None
        q: list | None = None if r.params.greedy else []
        drafts = [self._pick(r, st.logits, q)]
        x = st.x
        if k > 1:
            r.kv.reserve(P + k)
        for j in range(1, k):                    # chain: position P + j - 1 takes the last guess
            pos = P + j - 1
            step = prefill_step(r.seq, [drafts[-1]], pos, gather=True)
            logits, xs = self.model.mtp_forward(step, self.kv, x[None], 0)
            drafts.append(self._pick(r, logits[0], q))
            x = xs[0]
        return drafts, q

    def verified(self, r: Request) -> None:
        pass          # the engine reports the kept positions through `observe`

    def release(self, request_id: str) -> None:
        self.state.pop(request_id, None)
