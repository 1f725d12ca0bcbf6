"""The model under Hugging Face conventions (docs/hf.md), each against a slow obvious oracle:

- padded forward == packed forward, bit for bit (left, right and mixed padding, a short row in the middle
  of the batch; logits, hidden states, routed experts, labels loss, logits_to_keep, HF padding-free
  position_ids);
- `generate` greedy == TorchEngine greedy, and == generate without a cache (a full forward per step), for
  left-padded prompts of different lengths; the cache each row ends with == a solo packed prefill of the
  row's real tokens (padding never enters it); beam search with the cache == without; continuing a returned
  cache == a fresh generate on the whole history;
- sampled `output_scores` / `output_logits` at temperature 1 (no warpers): log_softmax == the trainer's
  `token_logprobs` (fp32, atol 1e-4); eos / custom stopping criteria end rows exactly where they should;
- generation_config saved and loaded; `pipeline("text-generation")` == greedy generate;
- TRL's GRPOTrainer, built from the checkpoint path, trains a few steps, and its per-token log-probs ==
  `token_logprobs` (slow);
- clear errors for bad input.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

from model.config import OdysseyConfig
from model.hf_cache import OdysseyHFCache
from model.kda import KDALayerState
from model.modeling import OdysseyForCausalLM
from rl.rollout.engine import GenerationRequest, TorchEngine
from rl.rollout.sampling import SamplingParams

LOGPROB_TOL = 1e-4  # fp32, trainer vs generate scores (issue 34)
CACHE_TOL = 1e-5  # decoded cache vs one packed prefill of the same tokens (fp32)


@pytest.fixture(scope="module")
def model() -> OdysseyForCausalLM:
    torch.manual_seed(0)
    m = OdysseyForCausalLM(OdysseyConfig.from_preset("tiny")).eval()
    with torch.no_grad():  # non-zero balancing biases so the biased top-k choice is exercised
        for moe in m.moe_layers():
            moe.router.e_score_correction_bias.normal_(0.0, 0.3)
    return m


def _seqs(lens: list[int], seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(16, 3000, (n,), generator=g) for n in lens]


def _pad(seqs: list[torch.Tensor], side: str, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] ids and 0/1 mask with each sequence at the left or right of its row."""
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for b, s in enumerate(seqs):
        sl = slice(T - len(s), T) if side == "left" else slice(0, len(s))
        ids[b, sl], mask[b, sl] = s, 1
    return ids, mask


def _cu(seqs: list[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor([len(s) for s in seqs]).cumsum(0).tolist(), dtype=torch.int32)


# ----------------------------------------------------------------------------- padded == packed
@pytest.mark.parametrize("side,lens", [("left", [5, 3, 7]), ("right", [5, 3, 7]), ("left", [6, 6]),
                                       ("right", [1, 9, 4, 9])])
@torch.no_grad()
def test_padded_forward_equals_packed(model, side, lens):
    seqs = _seqs(lens)
    ids, mask = _pad(seqs, side)
    packed = model(torch.cat(seqs), cu_seqlens=_cu(seqs), return_routed_experts=True)
    padded = model(ids, attention_mask=mask, return_routed_experts=True)
    hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
    h_packed, _, _, _ = model.model(torch.cat(seqs), _cu(seqs))
    keep = mask.bool()
    assert torch.equal(padded.logits[keep], packed.logits)  # bit-exact by construction
    assert torch.equal(padded.routed_experts[keep], packed.routed_experts)
    assert torch.equal(hidden[keep], h_packed)
    assert not padded.logits[~keep].any() and not hidden[~keep].any()  # zeros at padding

    # labels: a real token predicts the next real token of its row; padding labels are never targets
    labels = ids.masked_fill(~keep, 7)  # a non -100 label at padding must still be ignored
    labels[1, keep[1].nonzero()[1, 0]] = -100  # and -100 masks
    packed_labels = labels[keep]
    assert torch.equal(model(ids, attention_mask=mask, labels=labels).loss,
                       model(torch.cat(seqs), cu_seqlens=_cu(seqs), labels=packed_labels).loss)

    # logits_to_keep: the last k columns, as computed on all columns
    k = 2
    kept = model(ids, attention_mask=mask, logits_to_keep=k).logits
    assert kept.shape == (len(lens), k, model.config.vocab_size)
    assert torch.allclose(kept, padded.logits[:, -k:], atol=1e-6, rtol=0)


@torch.no_grad()
def test_padding_free_position_ids_equal_packed(model):
    """HF's padding-free layout: one row, position_ids restarting at 0 at each sequence start."""
    seqs = _seqs([4, 6, 3], seed=2)
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    out = model(torch.cat(seqs)[None], position_ids=pos)
    assert torch.equal(out.logits[0], model(torch.cat(seqs), cu_seqlens=_cu(seqs)).logits)


@torch.no_grad()
def test_cache_continuation_with_padded_mask(model):
    """A manual HF-style loop: prefill left-padded rows with use_cache, then feed 3 more tokens with the full
    [B, past + new] mask; the logits equal a packed forward of each row's real tokens."""
    seqs = _seqs([5, 2, 4], seed=3)
    more = _seqs([3, 3, 3], seed=4)
    ids, mask = _pad(seqs, "left")
    out = model(ids, attention_mask=mask, use_cache=True)
    assert isinstance(out.past_key_values, OdysseyHFCache)
    assert out.past_key_values.get_seq_length() == ids.shape[1]
    step = torch.stack(more)
    full_mask = torch.cat([mask, torch.ones_like(step)], 1)
    out2 = model(step, attention_mask=full_mask, past_key_values=out.past_key_values)
    assert out2.past_key_values.state.seq_lens.tolist() == [8, 5, 7]
    ref = model(torch.cat([torch.cat([s, m]) for s, m in zip(seqs, more)]),
                cu_seqlens=_cu([torch.cat([s, m]) for s, m in zip(seqs, more)])).logits
    ends = _cu([torch.cat([s, m]) for s, m in zip(seqs, more)])[1:]
    for b in range(3):
        assert torch.allclose(out2.logits[b], ref[ends[b] - 3: ends[b]], atol=1e-4, rtol=0)


@torch.no_grad()
def test_row_without_real_tokens(model):
    """An all-padding row gets zero logits and an empty cache row, and can be continued like a fresh one."""
    seqs = _seqs([4, 6], seed=15)
    ids, mask = _pad([seqs[0], torch.zeros(0, dtype=torch.long), seqs[1]], "left")
    out = model(ids, attention_mask=mask, use_cache=True)
    assert out.past_key_values.state.seq_lens.tolist() == [4, 0, 6]
    assert not out.logits[1].any()
    assert torch.equal(out.logits[mask.bool()], model(torch.cat(seqs), cu_seqlens=_cu(seqs)).logits)
    nxt = torch.tensor([[5], [7], [9]])
    out2 = model(nxt, attention_mask=torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1),
                 past_key_values=out.past_key_values)
    assert torch.allclose(out2.logits[1, 0], model(torch.tensor([7])).logits[0], atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- generate
def _torch_engine_greedy(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    eng = TorchEngine(model)
    sp = SamplingParams(temperature=0.0, max_new_tokens=n)
    return [r.token_ids for r in eng.generate([GenerationRequest(p, sp) for p in prompts])]


@torch.no_grad()
def test_generate_greedy_equals_torch_engine_and_no_cache(model):
    seqs = _seqs([6, 2, 9, 4], seed=5)
    ids, mask = _pad(seqs, "left")
    n = 12
    out = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0,
                         return_dict_in_generate=True)
    hf = out.sequences[:, ids.shape[1]:].tolist()
    assert hf == _torch_engine_greedy(model, [s.tolist() for s in seqs], n)
    no_cache = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0,
                              use_cache=False)
    assert no_cache[:, ids.shape[1]:].tolist() == hf

    # each row's cache holds only its real tokens: == a packed prefill of (prompt + generated[:-1]) alone
    cache = out.past_key_values
    assert cache.state.seq_lens.tolist() == [len(s) + n - 1 for s in seqs]
    for b, s in enumerate(seqs):
        ref = model(torch.cat([s, torch.tensor(hf[b][:-1])]), use_cache=True).cache
        for got, want in zip(cache.state.select([b]).layers, ref.layers):
            if isinstance(want, KDALayerState):
                assert torch.allclose(got.recurrent, want.recurrent, atol=CACHE_TOL, rtol=0)
                assert torch.allclose(got.conv, want.conv, atol=CACHE_TOL, rtol=0)
            else:
                assert got.lens == want.lens
                assert torch.allclose(got[0], want[0], atol=CACHE_TOL, rtol=0)


@torch.no_grad()
def test_generate_continues_a_returned_cache(model):
    """transformers' multi-turn cache reuse: generate again on (sequences + a new turn) with the cache the
    first call returned; generate feeds only the columns the cache lacks. == a fresh generate on the whole
    history."""
    seqs = _seqs([6, 3], seed=16)
    ids, mask = _pad(seqs, "left")
    first = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0,
                           return_dict_in_generate=True)
    hist = torch.cat([first.sequences, torch.stack(_seqs([3, 3], seed=17))], 1)
    hmask = torch.cat([mask, torch.ones(2, hist.shape[1] - mask.shape[1], dtype=torch.long)], 1)
    kw = dict(attention_mask=hmask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    cont = model.generate(hist, past_key_values=first.past_key_values, **kw)
    assert torch.equal(cont, model.generate(hist, **kw))


@torch.no_grad()
def test_generate_beam_search_with_cache_equals_without(model):
    seqs = _seqs([5, 3], seed=6)
    ids, mask = _pad(seqs, "left")
    kw = dict(attention_mask=mask, max_new_tokens=6, num_beams=3, num_return_sequences=2, do_sample=False,
              pad_token_id=0, early_stopping=True)
    assert torch.equal(model.generate(ids, **kw), model.generate(ids, use_cache=False, **kw))


@torch.no_grad()
def test_sampled_scores_equal_trainer_token_logprobs(model):
    """do_sample at temperature 1 with top_k 0 / top_p 1: no warper runs, so output_scores (processed) and
    output_logits (raw) are the same logits, and their log_softmax at the sampled token must equal the
    trainer's token_logprobs on the row's real tokens."""
    seqs = _seqs([7, 3, 5], seed=7)
    ids, mask = _pad(seqs, "left")
    torch.manual_seed(11)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=True, temperature=1.0,
                         top_k=0, top_p=1.0, pad_token_id=0, return_dict_in_generate=True, output_scores=True,
                         output_logits=True)
    gen = out.sequences[:, ids.shape[1]:]
    scores = torch.stack(out.scores, 1)  # [B, n, V]
    assert torch.equal(scores, torch.stack(out.logits, 1))
    lp_hf = torch.log_softmax(scores, -1).gather(-1, gen[..., None]).squeeze(-1)
    for b, s in enumerate(seqs):
        full = torch.cat([s, gen[b]])
        lp = model.token_logprobs(full[:-1], full[1:])[len(s) - 1:]
        assert torch.allclose(lp_hf[b], lp, atol=LOGPROB_TOL, rtol=0), (lp_hf[b] - lp).abs().max()


@torch.no_grad()
def test_stopping_criteria(model):
    """eos_token_id ends a row (then pad_token_id), other rows go on unchanged; a custom StoppingCriteria
    stops the whole batch at its step; max_length counts the prompt."""
    seqs = _seqs([4, 6], seed=8)
    ids, mask = _pad(seqs, "left")
    free = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    P = ids.shape[1]
    eos = int(free[0, P + 2])
    assert eos not in free[1, P:].tolist() and eos not in free[0, P:P + 2].tolist()  # the test's premise
    stopped = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                             eos_token_id=eos)
    assert stopped[0, P:].tolist() == free[0, P:P + 3].tolist() + [0] * 5
    assert torch.equal(stopped[1], free[1])

    class AfterThree(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= P + 3, dtype=torch.bool)

    short = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                           stopping_criteria=StoppingCriteriaList([AfterThree()]))
    assert torch.equal(short, free[:, :P + 3])
    assert torch.equal(model.generate(ids, attention_mask=mask, max_length=P + 5, do_sample=False,
                                      pad_token_id=0), free[:, :P + 5])


@torch.no_grad()
def test_generation_config_saved_and_loaded(model, tmp_path):
    model.generation_config.update(eos_token_id=4, pad_token_id=0, max_new_tokens=5, do_sample=False)
    try:
        model.save_pretrained(tmp_path)
    finally:
        model.generation_config.update(eos_token_id=None, pad_token_id=None, max_new_tokens=None)
    saved = json.loads((tmp_path / "generation_config.json").read_text())
    assert saved["eos_token_id"] == 4 and saved["max_new_tokens"] == 5
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, OdysseyForCausalLM)
    assert loaded.generation_config.eos_token_id == 4 and loaded.generation_config.max_new_tokens == 5
    ids = _seqs([6], seed=9)[0][None]
    out = loaded.generate(ids)  # the loaded generation_config decides: 5 new tokens, greedy
    n = out.shape[1] - ids.shape[1]
    assert 1 <= n <= 5
    assert out[0, ids.shape[1]:].tolist() == _torch_engine_greedy(model, [ids[0].tolist()], 5)[0][:n]


@torch.no_grad()
def test_text_generation_pipeline(model):
    from transformers import pipeline

    from model.tokenizer import load_tokenizer

    tok = load_tokenizer()
    pipe = pipeline("text-generation", model=model, tokenizer=tok, device="cpu")
    text = "The sandbox returned"
    out = pipe(text, max_new_tokens=6, do_sample=False, return_full_text=False)
    ids = tok(text, return_tensors="pt").input_ids
    ref = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out[0]["generated_text"] == tok.decode(ref[0, ids.shape[1]:], skip_special_tokens=True)
    # stop strings (transformers' StopStringCriteria, through the tokenizer): stop at the 3rd token's text
    # stop strings (transformers' StopStringCriteria, through the tokenizer): the first generated token k >= 1
    # whose text is new stops the greedy run right after it
    P = ids.shape[1]
    gen = ref[0, P:].tolist()
    k = next(i for i in range(1, len(gen)) if tok.decode(gen[i:i + 1]).strip()
             and tok.decode(gen[i:i + 1]) not in tok.decode(gen[:i]))
    cut = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id,
                         stop_strings=[tok.decode(gen[k:k + 1])], tokenizer=tok)
    assert cut[0, P:].tolist() == gen[:k + 1]
    batch = pipe([text, "x = 1 +"], max_new_tokens=4, do_sample=False, batch_size=2)
    assert [b[0]["generated_text"][: len(p)] for b, p in zip(batch, [text, "x = 1 +"])] == [text, "x = 1 +"]


# ----------------------------------------------------------------------------- errors
def test_bad_input_errors(model):
    ids = torch.randint(16, 100, (2, 5))
    with pytest.raises(ValueError, match=r"attention_mask must be \[batch, seq_len\] = \[2, 5\]"):
        model(ids, attention_mask=torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="either the packed form.*got attention_mask with the packed form"):
        model(ids[0], cu_seqlens=torch.tensor([0, 5], dtype=torch.int32), attention_mask=torch.ones(1, 5))
    with pytest.raises(ValueError, match="only 0 .padding. and 1"):
        model(ids, attention_mask=torch.full((2, 5), 2))
    from transformers import DynamicCache
    with pytest.raises(ValueError, match="must be an OdysseyHFCache"):
        model(ids, attention_mask=torch.ones(2, 5, dtype=torch.long), past_key_values=DynamicCache())
    with pytest.raises(ValueError, match="does not support inputs_embeds"):
        model(ids, inputs_embeds=torch.zeros(2, 5, 128))
    with pytest.raises(ValueError, match="labels must be"):
        model(ids, attention_mask=torch.ones(2, 5, dtype=torch.long), labels=ids[:, :4])
    with pytest.raises(ValueError, match="cache_implementation='static' is not supported"):
        model.generate(ids, max_new_tokens=2, cache_implementation="static")
    with pytest.raises(ValueError, match="stateful"):
        model.generate(ids[:1], max_new_tokens=2, assistant_model=model)
    cache = OdysseyHFCache(model.config)
    model(ids, attention_mask=torch.ones(2, 5, dtype=torch.long), past_key_values=cache)
    with pytest.raises(ValueError, match="cache holds 2 rows but the input has 1"):
        model(ids[:1, :1], attention_mask=torch.ones(1, 6, dtype=torch.long), past_key_values=cache)
    with pytest.raises(ValueError, match="cannot be cropped"):
        cache.crop(1)


# ----------------------------------------------------------------------------- TRL
@pytest.mark.slow
def test_trl_grpo_trainer_trains_the_checkpoint_as_loaded(model, tmp_path):
    """GRPOTrainer(model=<checkpoint dir>) loads it through AutoModelForCausalLM, generates with HF generate
    (left-padded prompts), and trains 2 steps with finite losses that move the weights; its per-token
    log-probs (TRL's fused LM head on model.model's padded forward) equal the trainer's token_logprobs."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from model.tokenizer import load_tokenizer

    ckpt = tmp_path / "ckpt"
    model.save_pretrained(ckpt)
    tok = load_tokenizer()
    prompts = ["2 + 2 =", "Name a prime:", "ls -la shows", "def f(x):"]

    def reward_len(completions: list[str], **kwargs) -> list[float]:
        return [-abs(len(c) - 12) / 12.0 for c in completions]

    args = GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, max_steps=2,
                      per_device_train_batch_size=4, num_generations=4, max_completion_length=6,
                      learning_rate=1e-3, logging_steps=1, report_to="none", save_strategy="no", seed=0,
                      gradient_checkpointing=True, dataloader_num_workers=0)
    trainer = GRPOTrainer(model=str(ckpt), reward_funcs=reward_len, args=args,
                          train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tok)
    policy = trainer.model
    assert isinstance(policy, OdysseyForCausalLM)
    before = {k: v.detach().clone() for k, v in policy.state_dict().items()}
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    moved = [k for k, v in policy.state_dict().items()
             if v.is_floating_point() and not torch.equal(v, before[k])]
    assert "lm_head.weight" in moved and any(".mixer." in k for k in moved)

    # TRL's per-token log-probs == ours, on a left-padded prompt + right-padded completion batch
    policy.eval()
    seqs = _seqs([5, 2, 7], seed=12)
    comps = _seqs([4, 4, 2], seed=13)
    P, C = max(len(s) for s in seqs), max(len(c) for c in comps)
    ids = torch.zeros(3, P + C, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, (s, c) in enumerate(zip(seqs, comps)):
        ids[b, P - len(s):P], ids[b, P:P + len(c)] = s, c
        mask[b, P - len(s):P + len(c)] = 1
    with torch.no_grad():
        trl_lp, _, _ = trainer._get_per_token_logps_and_entropies(policy, ids, mask, C)
        for b, (s, c) in enumerate(zip(seqs, comps)):
            full = torch.cat([s, c])
            ours = policy.token_logprobs(full[:-1], full[1:])[len(s) - 1:]
            gap = (trl_lp[b, :len(c)] - ours).abs().max()
            assert gap <= LOGPROB_TOL, gap
