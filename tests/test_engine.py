"""TorchEngine and sampling: oracle tests against slow obvious references.

- sampling: filter_logits vs a per-row Python reference; the sampler's empirical distribution vs the
  filtered probabilities; batch composition never changes a row's draw.
- engine: trainer/inference parity (token_logprobs == rollout logprobs, fp32, T = 1), R3 parity (recorded
  routing == a full forward's), continuous batching == one-at-a-time decoding, chunked prefill == one
  pass (and no forward over more than a chunk, LM head only on sampled positions), session continuation
  == re-running the whole history, stop tokens / strings / length, async batching, weight updates.
"""

from __future__ import annotations

import asyncio
import math
import threading

import numpy as np
import pytest
import torch

from model.config import OdysseyConfig
from model.modeling import OdysseyForCausalLM
from rl.rollout.engine import GenerationRequest, InferenceEngine, TorchEngine
from rl.rollout.sampling import SamplingParams, UniformStream, filter_logits, make_generator, sample_tokens

PARITY_TOL = 1e-4  # fp32 logprob parity, trainer vs rollout (issue 7)


@pytest.fixture(scope="module")
def model() -> OdysseyForCausalLM:
    torch.manual_seed(0)
    return OdysseyForCausalLM(OdysseyConfig.from_preset("tiny")).eval()


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(16, 3000, (n,), generator=g).tolist()


# ----------------------------------------------------------------------------- sampling
def _reference_filter(z: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    """Obvious per-row reference: scale, keep top-k (ties kept), keep the top-p nucleus."""
    z = [x / temperature for x in z]
    keep = set(range(len(z)))
    if top_k > 0:
        kth = sorted(z, reverse=True)[min(top_k, len(z)) - 1]
        keep = {i for i in keep if z[i] >= kth}
    if top_p < 1:
        m = max(z[i] for i in keep)
        p = {i: math.exp(z[i] - m) for i in keep}
        total = sum(p.values())
        order = sorted(keep, key=lambda i: (-z[i], i))
        mass, nucleus = 0.0, set()
        for i in order:
            if nucleus and mass >= top_p:
                break
            nucleus.add(i)
            mass += p[i] / total
        keep = nucleus
    return [z[i] if i in keep else -math.inf for i in range(len(z))]


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 7, 0.6), (1.0, 1, 1.0), (2.0, 0, 0.05)],
)
def test_filter_logits_matches_reference(temperature, top_k, top_p):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 40, generator=g) * 3
    N = logits.shape[0]
    z = filter_logits(logits, torch.full((N,), temperature), torch.full((N,), top_k), torch.full((N,), top_p))
    for r in range(N):
        ref = torch.tensor(_reference_filter(logits[r].tolist(), temperature, top_k, top_p))
        assert torch.equal(torch.isinf(z[r]), torch.isinf(ref)), (r, temperature, top_k, top_p)
        fin = ~torch.isinf(ref)
        assert torch.allclose(z[r][fin], ref[fin], atol=1e-5)


def test_sampler_follows_filtered_distribution():
    """Empirical frequencies of 20000 draws vs exp(logp) of the filtered distribution (5-sigma bound)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    params = SamplingParams(temperature=0.8, top_k=5, top_p=0.9)
    z = filter_logits(logits, torch.tensor([0.8]), torch.tensor([5]), torch.tensor([0.9]))
    probs = torch.softmax(z, -1)[0]
    g = make_generator(123)
    n = 20000
    counts = torch.zeros(6)
    for _ in range(n // 500):
        toks, lps = sample_tokens(logits.expand(500, -1), [params] * 500, [g] * 500)
        counts += torch.bincount(toks, minlength=6).float()
        assert torch.allclose(lps, probs.log()[toks], atol=1e-6)  # logprob of the sampled distribution
    freq = counts / n
    sigma = (probs * (1 - probs) / n).sqrt()
    assert torch.all((freq - probs).abs() <= 5 * sigma + 1e-9), (freq, probs)
    assert counts[probs == 0].sum() == 0  # filtered tokens are never drawn


def test_sampling_is_batch_independent_and_greedy_is_argmax():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(5, 50, generator=g)
    params = [
        SamplingParams(temperature=t, top_k=k, top_p=p, seed=i)
        for i, (t, k, p) in enumerate(
            [(1.0, 0, 1.0), (0.5, 3, 1.0), (1.0, 0, 0.7), (0.0, 0, 1.0), (2.0, 10, 0.9)]
        )
    ]
    batched, blp = sample_tokens(logits, params, [make_generator(i) for i in range(5)])
    for i in range(5):
        alone, alp = sample_tokens(logits[i : i + 1], [params[i]], [make_generator(i)])
        assert alone.item() == batched[i].item()
        assert alp.item() == pytest.approx(blp[i].item(), abs=1e-6)
    assert batched[3].item() == logits[3].argmax().item() and blp[3].item() == 0.0


def test_block_drawn_uniforms_give_the_same_tokens_as_per_token_draws():
    """The engine takes each request's uniforms in blocks (UniformStream); 150 steps of 4 rows (crossing
    block boundaries, mixed params incl. greedy) give exactly the tokens and logprobs of one draw per row
    and step."""
    params = [SamplingParams(seed=i, temperature=t, top_k=k) for i, (t, k) in
              enumerate([(1.0, 0), (0.0, 0), (0.7, 5), (1.0, 0)])]
    gens_a = [make_generator(i) for i in range(4)]
    streams = [UniformStream(make_generator(i), block=64) for i in range(4)]
    g = torch.Generator().manual_seed(9)
    for _ in range(150):
        logits = torch.randn(4, 30, generator=g) * 2
        ta, la = sample_tokens(logits, params, gens_a)
        u = torch.tensor([s.next() for s in streams], dtype=torch.float64)
        tb, lb = sample_tokens(logits, params, [s.generator for s in streams], uniforms=u)
        assert torch.equal(ta, tb) and torch.equal(la, lb)


def test_bad_sampling_params_are_named():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=-2)


# ----------------------------------------------------------------------------- engine
def _full_forward(model, ids: list[int]):
    with torch.no_grad():
        t = torch.tensor(ids)
        lp = model.token_logprobs(t[:-1], t[1:])
        routed = model(t, return_routed_experts=True).routed_experts
    return lp, routed


def test_engine_satisfies_protocol(model):
    assert isinstance(TorchEngine(model), InferenceEngine)


def test_trainer_inference_and_r3_parity(model):
    """Rollout logprobs == token_logprobs on the same tokens (T=1, top_p=1, top_k=0); routing == full
    forward's."""
    eng = TorchEngine(model, prefill_chunk_size=16)
    reqs = [
        GenerationRequest(_prompt(i, 20 + 9 * i), SamplingParams(max_new_tokens=12, seed=i)) for i in range(3)
    ]
    for req, res in zip(reqs, eng.generate(reqs)):
        ids = list(req.prompt_ids) + res.token_ids
        lp, routed = _full_forward(model, ids)
        P = len(req.prompt_ids)
        err = (lp[P - 1 :] - torch.tensor(res.logprobs)).abs().max().item()
        assert err < PARITY_TOL, err
        rec = np.concatenate([res.prompt_routed_experts, res.routed_experts]).astype(np.int64)
        assert rec.shape == (len(ids), len(model.moe_layer_indices), model.config.num_experts_per_tok)
        assert np.array_equal(rec, routed.numpy())
        assert res.session.num_tokens == len(ids) == int(res.session.cache.seq_lens[0])


def test_continuous_batching_equals_one_at_a_time(model):
    """max_batch_size=2 with 4 requests of different lengths: sequences join and leave mid-run."""
    reqs = [
        GenerationRequest(
            _prompt(10 + i, 5 + 7 * i),
            SamplingParams(max_new_tokens=3 + 4 * i, seed=100 + i, temperature=0.9, top_p=0.95),
        )
        for i in range(4)
    ]
    eng = TorchEngine(model, max_batch_size=2)
    batched = eng.generate(reqs)
    assert eng.stats["max_batch"] == 2
    for req, b in zip(reqs, batched):
        alone = TorchEngine(model).generate([req])[0]
        assert b.token_ids == alone.token_ids
        assert np.allclose(b.logprobs, alone.logprobs, atol=1e-5)
        assert np.array_equal(b.routed_experts, alone.routed_experts)
        assert len(b.token_ids) == req.sampling.max_new_tokens and b.finish_reason == "length"


def test_chunked_prefill_equals_one_pass_and_stays_chunked(model, monkeypatch):
    """Prefill of 300 tokens in chunks of 64 == one pass; no forward sees more than 64 tokens and the
    LM head runs only on the rows that are sampled from (never [T, vocab])."""
    prompt = _prompt(7, 300)
    req = GenerationRequest(prompt, SamplingParams(max_new_tokens=4, seed=3))
    one = TorchEngine(model, prefill_chunk_size=4096).generate([req])[0]
    seen_tokens, head_rows = [], []
    orig_backbone = model.model.forward
    orig_head = model.head_logits

    def spy_backbone(input_ids, *a, **k):
        seen_tokens.append(input_ids.shape[0])
        return orig_backbone(input_ids, *a, **k)

    def spy_head(h):
        head_rows.append(h.shape[0])
        return orig_head(h)

    monkeypatch.setattr(model.model, "forward", spy_backbone)
    monkeypatch.setattr(model, "head_logits", spy_head)
    chunked = TorchEngine(model, prefill_chunk_size=64).generate([req])[0]
    monkeypatch.undo()
    assert max(seen_tokens) <= 64 and len(seen_tokens) >= 300 // 64
    assert max(head_rows) == 1
    assert chunked.token_ids == one.token_ids
    assert np.allclose(chunked.logprobs, one.logprobs, atol=1e-4)
    assert np.array_equal(chunked.prompt_routed_experts, one.prompt_routed_experts)


def test_session_continuation_equals_full_history(model):
    """Turn 2 prefilled on the turn-1 session == generating from the whole history as one prompt."""
    eng = TorchEngine(model)
    t1 = eng.generate([GenerationRequest(_prompt(1, 30), SamplingParams(max_new_tokens=6, seed=1))])[0]
    obs = _prompt(2, 17)
    p2 = SamplingParams(max_new_tokens=6, seed=2)
    t2 = eng.generate([GenerationRequest(obs, p2, session=t1.session)])[0]
    history = _prompt(1, 30) + t1.token_ids + obs
    ref = TorchEngine(model).generate([GenerationRequest(history, p2)])[0]
    assert t2.token_ids == ref.token_ids
    assert np.allclose(t2.logprobs, ref.logprobs, atol=1e-4)
    assert np.array_equal(t2.prompt_routed_experts, ref.prompt_routed_experts[-len(obs) :])
    assert t2.session is t1.session and t2.session.num_tokens == len(history) + 6


def test_finish_reasons(model):
    tok_prompt = _prompt(5, 12)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    eng = TorchEngine(model, detokenize=lambda ids: "".join(f"<{i}>" for i in ids))
    base = eng.generate([GenerationRequest(tok_prompt, greedy)])[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 8
    assert all(lp == 0.0 for lp in base.logprobs)  # greedy: point mass
    stop_id = base.token_ids[2]
    first = base.token_ids.index(stop_id)
    r = eng.generate(
        [
            GenerationRequest(
                tok_prompt, SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=(stop_id,))
            )
        ]
    )[0]
    assert r.finish_reason == "stop_token" and r.token_ids == base.token_ids[: first + 1]
    s = f"<{base.token_ids[1]}><{base.token_ids[2]}>"
    r = eng.generate(
        [GenerationRequest(tok_prompt, SamplingParams(temperature=0.0, max_new_tokens=8, stop_strings=(s,)))]
    )[0]
    assert r.finish_reason == "stop_string" and r.token_ids == base.token_ids[:3]
    assert r.routed_experts.shape[0] == 3  # the last token was fed ("flushed") too


def test_agenerate_batches_concurrent_requests(model):
    reqs = [
        GenerationRequest(_prompt(20 + i, 10 + i), SamplingParams(max_new_tokens=5, seed=i)) for i in range(4)
    ]
    ref = TorchEngine(model).generate(reqs)
    eng = TorchEngine(model)

    async def main():
        return await asyncio.gather(*(eng.agenerate(r) for r in reqs))

    got = asyncio.run(main())
    assert [g.token_ids for g in got] == [r.token_ids for r in ref]
    assert eng.stats["max_batch"] == 4


def test_update_weights_and_errors(model):
    eng = TorchEngine(OdysseyForCausalLM(model.config).eval())
    req = GenerationRequest(_prompt(3, 10), SamplingParams(max_new_tokens=4, seed=9))
    before = eng.generate([req])[0]
    eng.update_weights(model.state_dict(), version=3)
    after = eng.generate([req])[0]
    assert eng.weight_version == 3 and after.weight_version == 3
    assert after.token_ids == TorchEngine(model).generate([req])[0].token_ids
    assert before.logprobs != after.logprobs
    with pytest.raises(ValueError, match="does not match the model"):
        eng.update_weights({"nope": torch.zeros(1)}, version=4)
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        eng.generate([GenerationRequest([], SamplingParams())])
    with pytest.raises(ValueError, match="detokenizer"):
        eng.generate([GenerationRequest([5], SamplingParams(stop_strings=("x",)))])


def test_aclose_fails_requests_taken_for_a_running_step(model):
    """Regression: a request `_serve` had taken for a step still running in the worker thread (`_joining`)
    used to stay unresolved forever after aclose(); it must fail with RuntimeError and free its session."""
    eng = TorchEngine(model)
    first = GenerationRequest(_prompt(40, 8), SamplingParams(max_new_tokens=2, seed=0))
    session = eng.generate([first])[0].session
    entered, go = threading.Event(), threading.Event()
    orig_step = eng._step

    def slow_step(*args, **kwargs):
        entered.set()
        go.wait(10)  # hold the step in the worker thread until the test lets it go
        return orig_step(*args, **kwargs)

    eng._step = slow_step
    req = GenerationRequest(_prompt(41, 6), SamplingParams(max_new_tokens=3, seed=1), session=session)

    async def main():
        task = asyncio.create_task(eng.agenerate(req))
        try:
            for _ in range(500):
                if entered.is_set():
                    break
                await asyncio.sleep(0.01)
            assert entered.is_set() and not eng._pending  # taken by the step now in the thread
            await eng.aclose()
            with pytest.raises(RuntimeError, match="closed while this request was in flight"):
                await asyncio.wait_for(task, timeout=2.0)  # a regression times out instead of hanging
        finally:
            go.set()
            if not task.done():
                task.cancel()

    asyncio.run(main())
    assert not session.busy


def test_generate_clears_busy_when_a_request_or_step_fails(model):
    """Regression: generate() used to leave sessions marked busy when a later request in the same call
    failed validation or `_step` raised; the error must propagate and the session stay usable."""
    eng = TorchEngine(model)
    p = SamplingParams(max_new_tokens=3, seed=2)
    session = eng.generate([GenerationRequest(_prompt(42, 8), p)])[0].session
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        eng.generate([GenerationRequest(_prompt(43, 4), p, session=session), GenerationRequest([], p)])
    assert not session.busy

    def failing_step(*args, **kwargs):
        raise RuntimeError("step failed")

    eng._step = failing_step
    with pytest.raises(RuntimeError, match="step failed"):
        eng.generate([GenerationRequest(_prompt(44, 4), p, session=session)])
    assert not session.busy
    del eng._step  # back to the class method

    r = eng.generate([GenerationRequest(_prompt(45, 5), p, session=session)])[0]
    assert r.session is session and len(r.token_ids) == 3 and not session.busy


# ----------------------------------------------------------------------------- weight updates (issue 12)
@pytest.fixture(scope="module")
def other_model(model) -> OdysseyForCausalLM:
    torch.manual_seed(1)
    return OdysseyForCausalLM(model.config).eval()


def _state(m: OdysseyForCausalLM) -> dict:
    return {k: v.clone() for k, v in m.state_dict().items()}


def test_session_after_weight_update_is_rebuilt_with_new_weights(model, other_model):
    """A session continued after update_weights never reuses its old-weights cache: turn 2 equals a
    fresh engine on the new weights generating from the whole history (tokens, logprobs, the new
    tokens' routing), and its tokens record the new version."""
    eng = TorchEngine(OdysseyForCausalLM(model.config).eval())
    eng.update_weights(_state(model), version=0)
    t1 = eng.generate([GenerationRequest(_prompt(1, 30), SamplingParams(max_new_tokens=6, seed=1))])[0]
    assert t1.token_versions == [0] * 6
    eng.update_weights(_state(other_model), version=1)
    obs = _prompt(2, 17)
    p2 = SamplingParams(max_new_tokens=6, seed=2)
    t2 = eng.generate([GenerationRequest(obs, p2, session=t1.session)])[0]
    history = _prompt(1, 30) + t1.token_ids + obs
    ref = TorchEngine(other_model).generate([GenerationRequest(history, p2)])[0]
    stale = TorchEngine(model).generate([GenerationRequest(history, p2)])[0]
    assert t2.token_ids == ref.token_ids and np.allclose(t2.logprobs, ref.logprobs, atol=1e-4)
    assert not np.allclose(t2.logprobs, stale.logprobs, atol=1e-3)  # the two policies do differ
    assert t2.prompt_len == len(obs)
    assert np.array_equal(t2.prompt_routed_experts, ref.prompt_routed_experts[-len(obs) :])
    assert t2.token_versions == [1] * 6 and t2.session.weight_version == 1
    assert t2.session.num_tokens == len(history) + 6 == len(t2.session.token_ids)


def test_update_mid_decode_continues_on_new_weights(model, other_model):
    """A partial rollout: weights change after the 4th sampled token of a running sequence. Every token's
    rollout logprob equals the full-forward logprob under the weights its version names (old weights
    before the switch, new after: the running cache was rebuilt, not reused)."""
    eng = TorchEngine(OdysseyForCausalLM(model.config).eval())
    eng.update_weights(_state(model), version=0)
    prompt = _prompt(3, 25)
    seq = eng._new_seq(GenerationRequest(prompt, SamplingParams(max_new_tokens=10, seed=5)))
    running, cache, _ = eng._step([], None, [seq])
    while len(seq.tokens) < 4:
        running, cache, _ = eng._step(running, cache, [])
    eng.update_weights(_state(other_model), version=1)
    while running:
        running, cache, _ = eng._step(running, cache, [])
    res = eng._result(seq)
    assert res.token_versions == [0] * 4 + [1] * 6
    ids = prompt + res.token_ids
    by_version = {0: _full_forward(model, ids)[0], 1: _full_forward(other_model, ids)[0]}
    P = len(prompt)
    for i, (lp, v) in enumerate(zip(res.logprobs, res.token_versions)):
        assert abs(by_version[v][P - 1 + i].item() - lp) < PARITY_TOL, (i, v)
    assert abs(by_version[0][P + 6].item() - res.logprobs[7]) > 1e-3  # old weights would differ there
    assert res.session.num_tokens == len(ids) and res.session.weight_version == 1


# ----------------------------------------------------------------------------- teacher forcing
@pytest.mark.parametrize("sampling", [SamplingParams(max_new_tokens=9, seed=5),
                                      SamplingParams(max_new_tokens=9, seed=6, temperature=0.8, top_k=50)],
                         ids=["plain", "filtered"])
def test_forced_tokens_score_like_the_sampled_ones(model, sampling):
    """Feeding a sampled turn back as forced_ids (new session, prefill chunks that split it) returns the
    same tokens, log-probs (under the same filtered distribution), routed experts and finish reason as
    sampling them did; the session then continues exactly like the sampled one."""
    prompt = _prompt(21, 40)
    sampled = TorchEngine(model).generate([GenerationRequest(prompt, sampling)])[0]
    eng = TorchEngine(model, prefill_chunk_size=7)  # forced positions fall in several chunks
    forced = eng.generate([GenerationRequest(prompt, sampling, forced_ids=sampled.token_ids)])[0]
    assert forced.token_ids == sampled.token_ids and forced.finish_reason == sampled.finish_reason
    assert np.allclose(forced.logprobs, sampled.logprobs, atol=1e-5), (forced.logprobs, sampled.logprobs)
    assert np.array_equal(forced.routed_experts, sampled.routed_experts)
    assert np.array_equal(forced.prompt_routed_experts, sampled.prompt_routed_experts)
    assert forced.prompt_len == len(prompt) and forced.token_versions == [0] * len(sampled.token_ids)
    obs, nxt = _prompt(22, 11), SamplingParams(max_new_tokens=5, seed=7)
    a = TorchEngine(model).generate([GenerationRequest(obs, nxt, session=sampled.session)])[0]
    b = eng.generate([GenerationRequest(obs, nxt, session=forced.session)])[0]
    assert a.token_ids == b.token_ids and np.allclose(a.logprobs, b.logprobs, atol=1e-5)
    assert forced.session.num_tokens == len(prompt) + len(sampled.token_ids) + len(obs) + 5


def test_forced_tokens_match_the_trainer_and_continue_an_empty_prompt(model):
    """forced_ids with no new prompt tokens are scored by the session's next-token logits; every forced
    log-prob equals the trainer's token_logprobs on the whole conversation (the oracle), and so do the
    routed experts. A stop token at the end finishes the turn with "stop_token"."""
    eng = TorchEngine(model)
    prompt, turn1, turn2 = _prompt(31, 25), _prompt(32, 6), _prompt(33, 8)
    stop = SamplingParams(max_new_tokens=100, stop_token_ids=(turn2[-1],))
    r1 = eng.generate([GenerationRequest(prompt, stop, forced_ids=turn1)])[0]
    r2 = eng.generate([GenerationRequest([], stop, session=r1.session, forced_ids=turn2)])[0]
    assert r1.finish_reason == "length" and r2.finish_reason == "stop_token" and r2.prompt_len == 0
    ids = prompt + turn1 + turn2
    lp, routed = _full_forward(model, ids)
    got = torch.tensor(r1.logprobs + r2.logprobs)
    assert (lp[len(prompt) - 1 :] - got).abs().max().item() < PARITY_TOL
    rec = np.concatenate([r1.prompt_routed_experts, r1.routed_experts, r2.routed_experts]).astype(np.int64)
    assert np.array_equal(rec, routed.numpy())
    with pytest.raises(ValueError, match="prompt_ids is empty and there is no session"):
        eng.generate([GenerationRequest([], stop, forced_ids=turn1)])
