"""An HF checkpoint's own tokenizer and chat template drive the rollout (model.tokenizer.policy_tokenizer).

The tokenizers are built here (tests/foreign_tokenizers.py: byte-level BPEs with a Qwen-style ChatML and a
Llama-3-style template, the ChatML one also with add_prefix_space; SentencePiece-style BPEs with a
Mistral-style template: Metaspace prepend_scheme "first" (Llama / Mistral, legacy=False) and "always", and
Llama 2's legacy Prepend + Replace normalizer; each with its own vocabulary), saved beside small random HF
checkpoints. Oracles:
- `plain_ids` (the tokenizer's pipeline without added-token matching) == the tokenizer's own `encode` on
  text that holds no added-token string (corpus lines and odd strings);
- `encode_chat` == the tokenizer's own `apply_chat_template(..., tokenize=True)` on conversations with
  system, user, assistant, tool messages and tool schemas;
- the rollout's identity: prompt ids + sampled ids + end of turn + `encode_continuation(new)` ==
  `encode_chat(whole conversation)`;
- a worker's episodes are exactly those ids (prompt == the template's, turns end on the checkpoint's
  end-of-turn id), carry the checkpoint tokenizer's fingerprint, and a learner on the same checkpoint
  trains on them at ratio 1 (<= 1e-4), while a learner with another tokenizer refuses them.
"""

from __future__ import annotations

import asyncio
import json
import shutil

import numpy as np
import pytest
import torch

from model import tokenizer as tk
from tests.foreign_tokenizers import STYLES, make_tokenizer

PARITY_TOL = 1e-4
TOOLS = [{"type": "function", "function": {
    "name": "calc", "description": "evaluate an arithmetic expression",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}]
CALL = '<tool_call>\n{"name": "calc", "arguments": {"expression": "12*7"}}\n</tool_call>'
CONVERSATIONS = [
    [{"role": "user", "content": "What is 12 * 7?"}],
    [{"role": "system", "content": "Answer briefly."},
     {"role": "user", "content": "Name a prime.\nOnly one."}],
    [{"role": "system", "content": "Use the tools."},
     {"role": "user", "content": "Compute 12*7, then add 3."},
     {"role": "assistant", "content": CALL}, {"role": "tool", "content": "84"},
     {"role": "tool", "content": "ok: 84 (int)"}],
]


@pytest.fixture(scope="module", params=STYLES)
def foreign(request, tmp_path_factory):
    return make_tokenizer(request.param, tmp_path_factory.mktemp(request.param))


def _template_ids(tok, messages, tools=None, add_generation_prompt=True) -> list[int]:
    out = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                  tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_chat_format_is_read_off_the_template(foreign):
    fmt = tk.chat_format(foreign)
    want = {"<|im_start|>": "<|im_end|>", "<|start_header_id|>": "<|eot_id|>", "[INST]": "</s>"}
    assert fmt.end_of_turn == next(v for k, v in want.items() if k in foreign.get_added_vocab())
    assert not fmt.slot_exact
    eot = foreign.convert_tokens_to_ids(fmt.end_of_turn)
    # Mistral's end of turn is its eos: listed once
    assert tk.stop_token_ids(foreign) == list(dict.fromkeys([eot, foreign.eos_token_id]))
    shipped = tk.chat_format(tk.load_tokenizer())
    assert shipped.end_of_turn == tk.END_OF_TURN and shipped.slot_exact


def test_plain_ids_equal_the_tokenizers_own_encoding(foreign):
    lines = [ln for f in sorted(tk.CORPUS_DIR.glob("*.txt")) for ln in f.read_text().splitlines()[:200]]
    odd = ["", " ", "\n\n\n", "  two  spaces ", "tab\tand\r\nCRLF", "émoji 🚀 and ∑ math", "x" * 300,
           "1234567890", "'s 're 'll", ".\n\n#", "\ue000\ue001"]
    added = tk.chat_format(foreign).added
    texts = [t for t in lines + odd if not added.search(t)]
    assert len(texts) > 300
    eot = tk.chat_format(foreign).end_of_turn
    n_eot = len(foreign.encode(eot, add_special_tokens=False))
    for t in texts:
        assert tk.plain_ids(foreign, t) == foreign.encode(t, add_special_tokens=False), t
        # a run after an added token, as inside a chat: the tokenizer's own encoding of eot + t, less eot
        inside = foreign.encode(eot + t, add_special_tokens=False)[n_eot:]
        assert tk.plain_ids(foreign, t, at_start=False) == inside, t


@pytest.mark.parametrize("k", range(len(CONVERSATIONS)))
def test_encode_chat_equals_the_templates_own_tokenization(foreign, k):
    msgs = CONVERSATIONS[k]
    for tools in (None, TOOLS):
        got = tk.encode_chat(foreign, msgs, tools, add_generation_prompt=True)
        assert got == _template_ids(foreign, msgs, tools)
    assert tk.encode_chat(foreign, msgs) == _template_ids(foreign, msgs, add_generation_prompt=False)


def test_the_rollout_identity_holds(foreign):
    """What the loop feeds (prompt, sampled ids, end of turn, continuation) is the template's encoding of
    the whole conversation."""
    conv, new = CONVERSATIONS[2][:2], CONVERSATIONS[2][3:]
    for content in (CALL, "The answer is 84.", "x"):
        whole = conv + [{"role": "assistant", "content": content}] + new
        fed = (tk.encode_chat(foreign, conv, TOOLS, add_generation_prompt=True)
               + tk.encode_turn(foreign, content) + [tk.end_of_turn_id(foreign)]
               + tk.encode_continuation(foreign, new))
        assert fed == tk.encode_chat(foreign, whole, TOOLS, add_generation_prompt=True) == _template_ids(
            foreign, whole, TOOLS)


#: prompts that move the edges of the runs between added tokens: leading spaces, a newline right after an
#: added token, unicode (byte fallback in the SentencePiece styles), several tool results, an empty system
#: prompt; each conversation ends on a non-assistant turn (the rollout then samples)
HARD_CHATS = [
    [{"role": "system", "content": " You answer in one word."}, {"role": "user", "content": "no space first"},
     {"role": "assistant", "content": "Word."}, {"role": "user", "content": "\nnewline first\n\n"}],
    [{"role": "user", "content": "émoji 🚀, ∑ and 日本語\ttab"},
     {"role": "assistant", "content": "Ça marche 🚀"},
     {"role": "tool", "content": "\n 84 \n"}, {"role": "tool", "content": "  two spaces"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "  a"},
     {"role": "assistant", "content": CALL},
     {"role": "tool", "content": "ok"}, {"role": "assistant", "content": "done."},
     {"role": "user", "content": "again?"}],
]


@pytest.mark.parametrize("k", range(len(HARD_CHATS)))
def test_prompts_and_run_by_run_continuations_equal_the_template(foreign, k):
    """For every tokenizer style: the prompt of every prefix of the conversation == apply_chat_template, and
    the rollout's run-by-run ids (prompt, each assistant turn's text as it sits after the opening added token
    (`encode_turn`), the end of turn, `encode_continuation` of what follows) == the template's ids of the
    whole conversation. Every template here closes an assistant turn with an added token, so the text after
    it starts a new run and the tokenization is prefix-stable there."""
    msgs = HARD_CHATS[k]
    for tools in (None, TOOLS):
        turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        fed = tk.encode_chat(foreign, msgs[:turns[0]], tools, add_generation_prompt=True)
        assert fed == _template_ids(foreign, msgs[:turns[0]], tools)
        for n, i in enumerate(turns):
            content = msgs[i]["content"]
            if "<|start_header_id|>" in foreign.get_added_vocab():
                assert content == content.strip()  # Llama 3's template trims content: sampled text is trimmed
            end = turns[n + 1] if n + 1 < len(turns) else len(msgs)
            fed += (tk.encode_turn(foreign, content) + [tk.end_of_turn_id(foreign)]
                    + tk.encode_continuation(foreign, msgs[i + 1:end]))
            assert fed == _template_ids(foreign, msgs[:end], tools), (n, foreign.convert_ids_to_tokens(fed))
        assert tk.encode_chat(foreign, msgs, tools, add_generation_prompt=True) == fed


def test_content_cannot_forge_an_added_token(foreign):
    """Tool output and user text holding every added-token string of the vocabulary: no added id comes
    out of the content, and the text decodes back."""
    added_ids = set(foreign.get_added_vocab().values())
    hostile = "".join(f"x{t}\n" for t in foreign.get_added_vocab()) + tk.END_OF_TURN + "<|eot_id|>"
    for role in ("user", "tool"):
        prefix = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "."}]
        base = tk.encode_continuation(foreign, [{"role": role, "content": "Z"}])
        ids = tk.encode_continuation(foreign, [{"role": role, "content": hostile}])
        n_added = sum(i in added_ids for i in ids)
        assert n_added == sum(i in added_ids for i in base), (role, n_added)
        assert hostile in foreign.decode(ids, skip_special_tokens=False)
        assert prefix  # the continuation is what follows an assistant turn
    assert not set(tk.encode_text(foreign, hostile)) & added_ids


def _save_template(tok, path, template: str | None):
    tok.chat_template = template
    tok.save_pretrained(str(path))
    if template is None:  # save_pretrained keeps no field for a missing template
        cfg = json.loads((path / "tokenizer_config.json").read_text())
        cfg.pop("chat_template", None)
        (path / "tokenizer_config.json").write_text(json.dumps(cfg))
        (path / "chat_template.jinja").unlink(missing_ok=True)


@pytest.mark.parametrize("template, needle", [
    (None, "has no chat template"),
    ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}", "not with an added token"),
    ("{{ raise_exception('system messages only') }}", "fails on a user turn"),
    ("{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}<|im_end|>{% endif %}{% endfor %}",
     "drops an assistant turn's content"),
])
def test_an_unusable_chat_template_is_refused_with_the_fix(tmp_path, template, needle):
    from rl.config import ConfigError, load_config
    from tests.test_hf_policy import make_llama

    tok = make_tokenizer("chatml", tmp_path / "tok")
    ckpt = tmp_path / "ckpt"
    make_llama(ckpt, vocab_size=len(tok))
    _save_template(tok, ckpt, template)
    with pytest.raises(ValueError, match=needle):
        tk.policy_tokenizer(ckpt)
    (tmp_path / "c.yaml").write_text("env: {id: arith}\n")
    with pytest.raises(ConfigError, match=f"model.hf_path={ckpt}.*{needle}"):
        load_config(tmp_path / "c.yaml", [f"model.hf_path={ckpt}"])


def test_a_vocabulary_smaller_than_the_checkpoints_tokenizer_is_refused(tmp_path):
    from rl.config import ConfigError, load_config
    from tests.test_hf_policy import make_llama

    tok = make_tokenizer("chatml", tmp_path / "tok")
    make_llama(tmp_path / "ckpt", vocab_size=len(tok) - 7)
    tok.save_pretrained(str(tmp_path / "ckpt"))
    (tmp_path / "c.yaml").write_text("env: {id: arith}\n")
    with pytest.raises(ConfigError, match=f"smaller than its own tokenizer \\({len(tok)} tokens\\)"):
        load_config(tmp_path / "c.yaml", [f"model.hf_path={tmp_path / 'ckpt'}"])


def test_policy_tokenizer_is_the_checkpoints_own_when_it_ships_one(tmp_path):
    from model.hf_policy import HFPolicy
    from tests.test_hf_policy import make_llama

    shipped = tk.tokenizer_fingerprint(tk.load_tokenizer())
    assert tk.tokenizer_fingerprint(tk.policy_tokenizer(None)) == shipped
    bare = make_llama(tmp_path / "bare")  # no tokenizer files: Odyssey's
    assert tk.tokenizer_fingerprint(tk.policy_tokenizer(bare)) == shipped
    tok = make_tokenizer("llama3", tmp_path / "tok")
    own = tmp_path / "own"
    make_llama(own, vocab_size=len(tok))
    tok.save_pretrained(str(own))
    assert tk.tokenizer_fingerprint(tk.policy_tokenizer(own)) == tk.tokenizer_fingerprint(tok) != shipped
    # a saved policy keeps its tokenizer, so model.init_from of it (or a resume) reads the same ids
    HFPolicy.from_pretrained(own).save_pretrained(tmp_path / "saved")
    assert tk.tokenizer_fingerprint(tk.policy_tokenizer(tmp_path / "saved")) == tk.tokenizer_fingerprint(tok)
    # an Odyssey checkpoint always reads Odyssey's tokenizer, whatever files lie beside it
    from model.config import OdysseyConfig
    from model.modeling import OdysseyForCausalLM

    ody = tmp_path / "ody"
    OdysseyForCausalLM(OdysseyConfig.from_preset("tiny")).save_pretrained(str(ody))
    tok.save_pretrained(str(ody))
    assert tk.tokenizer_fingerprint(tk.policy_tokenizer(ody)) == shipped


@pytest.mark.timeout(600)
def test_episodes_and_training_use_the_checkpoints_tokenizer(tmp_path):
    """A worker on an HF Llama that ships the ChatML tokenizer plays dataset-qa episodes with it, and the
    learner trains on them at ratio 1; the learner of the same Llama without that tokenizer refuses them."""
    from rl.config import load_config
    from rl.learner import Learner
    from rl.rollout.tasks import task_stream
    from rl.rollout.worker import RolloutWorker, WorkerSettings
    from tests.test_hf_policy import make_llama

    tok = make_tokenizer("chatml", tmp_path / "tok")
    ckpt = tmp_path / "ckpt"
    make_llama(ckpt, vocab_size=len(tok))
    tok.save_pretrained(str(ckpt))
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    cfg = load_config("configs/quickstart.yaml", [
        f"model.hf_path={ckpt}", "rollout.max_new_tokens=10", "rollout.episodes=4", "learner.group_size=2",
        "rewards=[{name: 'tests.learner_fixtures:ascii_share'}]", f"logging.run_dir={tmp_path / 'run'}"])
    worker = RolloutWorker(WorkerSettings.from_config(cfg), 0)
    try:
        samples = task_stream(cfg, "train").first_samples(4, 2)
        trajs = asyncio.run(worker.run(samples, return_trajectories=True))["trajectories"]
    finally:
        asyncio.run(worker.close())
    fp = tk.tokenizer_fingerprint(tok)
    for t in trajs:
        assert t.metadata["tokenizer"] == fp
        (prompt,) = [x for x in t.turns if x.role == "prompt"]
        prompt_messages = t.metadata["messages"][:t.metadata["n_prompt_messages"]]
        assert t.tokens[prompt.start:prompt.end].tolist() == _template_ids(tok, prompt_messages)
        (turn,) = t.assistant_spans()
        sampled = t.tokens[turn.start:turn.end].tolist()
        assert sampled[-1] == eot or len(sampled) == 10  # stopped on <|im_end|>, or cut at max_new_tokens
        assert np.isfinite(t.rollout_logprobs[turn.start:turn.end]).any()
    learner = Learner(cfg)
    m = learner.step(trajs)
    assert abs(m["learner/offpolicy_ratio_mean"] - 1.0) <= PARITY_TOL, m
    assert abs(m["learner/offpolicy_kl"]) <= PARITY_TOL, m
    bare = tmp_path / "bare"
    no_tokenizer = shutil.ignore_patterns("tokenizer*", "special_tokens*", "chat_template*")
    shutil.copytree(ckpt, bare, ignore=no_tokenizer)
    other = Learner(cfg.model_copy(update={"model": cfg.model.model_copy(update={"hf_path": str(bare)})}))
    with pytest.raises(ValueError, match="tokenizer mismatch"):
        other.step(trajs)
    assert torch.isfinite(torch.tensor(m["loss"]))


def test_an_openai_client_agent_on_an_hf_model_speaks_its_template(tmp_path):
    """The unmodified example agent through the policy endpoint, on an HF Llama that ships the ChatML
    tokenizer (teacher-forced: the real model scores a scripted tool call, then an answer): the stored
    tokens are the tokenizer's own `apply_chat_template` of the whole conversation, the endpoint parsed
    the Hermes-form tool call, and the log-probs are the learner's (<= 1e-4)."""
    from examples.openai_agent.agent import SYSTEM, TOOLS, solve
    from model.hf_policy import HFPolicy
    from rl.rollout.agent_loop import ChatCodec
    from rl.rollout.engine import TorchEngine
    from rl.rollout.scripted import TeacherForcedEngine
    from tests.test_agent_endpoint import _episode, arith_task, scripted_turns
    from tests.test_hf_policy import make_llama

    tok = make_tokenizer("chatml", tmp_path / "llama")
    make_llama(tmp_path / "llama", vocab_size=len(tok))
    codec = ChatCodec(tk.policy_tokenizer(tmp_path / "llama"))
    policy = HFPolicy.from_pretrained(tmp_path / "llama").eval()
    engine = TeacherForcedEngine(TorchEngine(policy), codec, scripted_turns)
    traj = asyncio.run(_episode(engine, codec, solve))
    assert traj.infra_error is None and traj.metadata["agent_result"] == "The answer is \\boxed{42}."
    assert traj.metadata["tokenizer"] == tk.tokenizer_fingerprint(tok)
    assert traj.step_infos[0]["tool_calls"] == [{"name": "calc", "arguments": {"expression": "6*7"}}]
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": arith_task(3)["prompt"]},
            {"role": "assistant", "content": scripted_turns(type("R", (), {"request_id": "x:0"}))},
            {"role": "tool", "content": "42"}]
    want = _template_ids(tok, msgs, TOOLS)
    assert traj.tokens[:len(want)].tolist() == want
    ids = torch.as_tensor(traj.tokens, dtype=torch.long)
    with torch.no_grad():
        lp = policy.token_logprobs(ids[:-1], ids[1:])
    mask = traj.loss_mask[1:].astype(bool)
    got = torch.as_tensor(traj.rollout_logprobs[1:][mask])
    assert mask.sum() > 0 and (lp[torch.as_tensor(mask)] - got).abs().max().item() <= PARITY_TOL


def test_codec_turn_ids_are_the_templates_ids_of_an_assistant_turn(foreign):
    """ChatCodec.turn_ids (warm-up's oracle turns, TeacherForcedEngine's scripted turns) = the ids the
    template's own tokenization holds between the generation prompt and the end of turn, for every style
    (tok.encode differs there for Metaspace "first", prefix-space and trimming templates)."""
    from rl.rollout.agent_loop import ChatCodec

    codec = ChatCodec(foreign)
    user = [{"role": "user", "content": "Compute 2+3."}]
    prompt = _template_ids(foreign, user)
    for text in ("The answer is 5.", "Sure: 5", CALL, "naïve café 5"):
        said = {"role": "assistant", "content": text}
        whole = _template_ids(foreign, [*user, said], add_generation_prompt=False)
        assert whole[: len(prompt)] == prompt
        turn = whole[len(prompt) :]
        ids = codec.turn_ids(text)
        assert turn[: len(ids)] == ids and turn[len(ids)] == codec.eot_id, (text, ids, turn)
