"""Decode rows and prompt chunks in one step of the native runtime (engine.step's merged path): the
weights are read once for both, the running streams keep getting a token every step, and no request's
tokens change: the native step computes every row on its own (row-invariant), so a prompt gives the
same tokens whether its chunks ran beside decode rows or alone, on the exact and the fast path."""
import pytest
import torch
from support import engine
from test_engine import PROMPTS, SYSTEM, alone, assert_idle, drain, greedy, ids

from slipstream.engine.request import Request
from slipstream.kernels.cpu import load_library


@pytest.mark.parametrize("exact", [True, False])
def test_prompt_chunks_ride_along_with_the_decode_rows(llm, exact):
    e = engine(llm, prefill_chunk=512, prefill_budget=8, exact=exact)
    assert e.runtime.name == "native"
    merged = []
    inner = e.executor.decode_and_prefill

    def spy(batch, chunks, **kw):
        merged.append((len(batch), sum(end - start for _, start, end in chunks)))
        return inner(batch, chunks, **kw)
    e.executor.decode_and_prefill = spy
    first = Request(ids(llm, PROMPTS[0]), greedy(40, ignore_eos=True))
    e.add_request(first)
    e.step()                                              # alone: prefilled, decoding from now on
    # the fast path's prompt stays within one native prefill step when alone too (<= 64 tokens); the
    # exact path's goes through the eager BLAS step alone, within float32 noise of the native one
    text = PROMPTS[2] if not exact else SYSTEM + "Explain undefined behaviour."
    second_ids = ids(llm, text)
    second = Request(second_ids, greedy(12, ignore_eos=True))
    e.add_request(second)
    while not second.output_ids:                          # until its prompt is complete
        produced = len(first.output_ids)
        e.step()
        assert len(first.output_ids) == produced + 1, "the running stream waited behind the prefill"
    assert len(merged) >= len(second_ids) // 8 and all(rows == 1 and 0 < toks <= 8 for rows, toks in merged)
    drain(e, [first, second])
    assert second.output_ids == alone(llm, second_ids, greedy(12, ignore_eos=True), exact)
    assert first.output_ids == alone(llm, first.prompt_ids, greedy(40, ignore_eos=True), exact)
    assert_idle(e)


def test_speculation_keeps_separate_steps(llm):
    """With a proposer, decode steps verify guesses (rows of their own): nothing is merged."""
    e = engine(llm, prefill_chunk=512, prefill_budget=8, speculative="ngram")
    calls = []
    e.executor.decode_and_prefill = lambda *a: calls.append(a)
    a = Request(ids(llm, PROMPTS[5]), greedy(24, ignore_eos=True))
    e.add_request(a)
    e.step()
    b = Request(ids(llm, PROMPTS[2]), greedy(4))
    e.add_request(b)
    drain(e, [a, b])
    assert not calls
    assert_idle(e)


def test_long_prompt_chunks_on_the_native_step_where_it_is_faster(llm):
    """On x86 the fast path takes whole prompt chunks (up to 512 tokens) of the default model (Q4_1) on the
    native step (products on AMX tiles where the CPU has them, else the vector kernels 8 rows at a time);
    elsewhere chunks of more than 64 tokens run eagerly (`cpu_team.long_chunks_native`). Either way a
    300-token prompt gives the tokens it gives in chunks of 32 (rows are computed alike whatever shares
    their step), and the step keeps logits for its output rows only."""
    from slipstream.runtime.cpu_team import long_chunks_native
    native = long_chunks_native(load_library(), llm.model)
    assert native == load_library().ss_isa().decode().startswith(("avx2", "avx512"))   # the default model: Q4_1
    prompt = (ids(llm, PROMPTS[0]) * 40)[:300]
    e = engine(llm, prefill_chunk=512, exact=False)
    seen = []
    inner = e.executor.prefill_batches
    e.executor.prefill_batches = lambda chunks: seen.append(inner(chunks)) or seen[-1]
    r = Request(prompt, greedy(8, ignore_eos=True))
    e.add_request(r)
    drain(e, [r])
    big = [b for batches in seen for b in batches if sum(end - s for _, s, end in b.chunks) > 64]
    assert big and all(b.on_runtime == native for b in big)
    if native:
        assert e.runtime._bufs.logits.shape[0] <= 8      # not one row of logits per prompt token
    small = engine(llm, prefill_chunk=32, exact=False)
    r2 = Request(prompt, greedy(8, ignore_eos=True))
    small.add_request(r2)
    drain(small, [r2])
    assert r.output_ids == r2.output_ids
    assert_idle(e)


def test_the_eager_prompt_step_multiplies_in_bf16_where_the_runtime_asks(llm, monkeypatch):
    """Prompt chunks longer than the native step takes run on the model's eager (BLAS) step; on AMX machines
    the fast path runs it in bf16 where the CPU multiplies bf16 in hardware (AMX, AVX-512 BF16:
    `CpuTeamDecoder.eager_blas`, weights.quant.blas_mode), the exact path never (fp32, in fixed row blocks).
    Forced here on any CPU (torch multiplies bf16 everywhere, only slower without those units)."""
    from slipstream.kernels.cpu import load_library
    from slipstream.runtime.cpu_team import bf16_blas_fast
    from slipstream.weights import quant
    hw = bf16_blas_fast(load_library())
    assert engine(llm, exact=True).runtime.eager_blas == "fp32-fixed"
    e = engine(llm, prefill_chunk=512, exact=False)
    assert e.runtime.eager_blas == ("bf16" if hw else "fp32")
    monkeypatch.setattr(e.runtime, "prefill_tokens", 64)
    monkeypatch.setattr(e.runtime, "eager_blas", "bf16")
    seen = []
    inner = e.executor.model.forward

    def spy(step, kv, **kw):
        seen.append((step.token_ids.numel(), getattr(quant._path, "blas", "fp32") == "bf16"))
        return inner(step, kv, **kw)
    monkeypatch.setattr(e.executor.model, "forward", spy)
    prompt = (ids(llm, PROMPTS[0]) * 40)[:300]
    r = Request(prompt, greedy(8, ignore_eos=True))
    e.add_request(r)
    drain(e, [r])
    assert any(rows > 64 for rows, _ in seen) and all(bf16 for rows, bf16 in seen if rows >= 32)
    assert len(r.output_ids) == 8
    assert getattr(quant._path, "blas", "fp32") == "fp32"   # left as it was
    assert_idle(e)


def test_a_prompt_on_the_eager_step_is_the_same_beside_another(llm, monkeypatch):
    """On the exact path, two prompts of ~100 tokens prefilled together on the eager (BLAS) step give the second
    the first-token logits it gets alone, bit for bit, and the same tokens: the fp32 BLAS path multiplies a
    fixed number of rows per call (quant.BLAS_ROWS), since oneDNN's GEMM rounds a row differently beside other
    rows (this failed with one call per chunk)."""
    from slipstream.engine.sampling import SamplingParams
    gen = torch.Generator().manual_seed(1)
    first, second = (torch.randint(100, llm.model.cfg.vocab_size, (n,), generator=gen).tolist() for n in (110, 95))

    def run(prompts):
        e = engine(llm, enable_prefix_cache=False, exact=True)
        monkeypatch.setattr(e.runtime, "prefill_tokens", 64)   # both go to the eager step, in one batch
        seen = {}
        inner = e.executor._prefill

        def spy(batch):
            done, logits = inner(batch)
            assert not batch.on_runtime
            seen.update({r.request_id: (logits[i].clone(), len(batch.chunks)) for i, r in enumerate(done)})
            return done, logits
        monkeypatch.setattr(e.executor, "_prefill", spy)
        rs = [Request(list(p), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)) for p in prompts]
        for r in rs:
            e.add_request(r)
        drain(e, rs)
        return seen[rs[-1].request_id], rs[-1].output_ids

    (alone, n_alone), tokens_alone = run([second])
    (beside, n_beside), tokens_beside = run([first, second])
    assert (n_alone, n_beside) == (1, 2)
    assert torch.equal(alone, beside) and tokens_alone == tokens_beside
