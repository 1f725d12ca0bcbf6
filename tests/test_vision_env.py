"""vision-arith and tool images (envs/vision_arith.py, envs/tool_result.py, rl/warmup.py with images).

The expression exists only in the image `look` returns: the oracle solves every level, two tasks with the
same text need different answers, the blank ablation keeps the size and removes the content, the warm-up
transcript is the agent loop's trajectory with its images, the SFT loss with images equals a full forward
(and depends on the pixels), a short warm-up lowers the loss, and (docker) the sandbox renders the same
PNG as the in-process path."""

from __future__ import annotations

import asyncio
import io

import numpy as np
import pytest
import torch
from PIL import Image

import envs
from envs.sandbox_scripts import glyphs
from envs.spaces import ChatMessages
from envs.tool_call import format_tool_call
from envs.tool_result import ToolResult
from model.config import OdysseyConfig
from model.image_tokens import IMAGE_START_ID
from model.modeling import IGNORE_INDEX, OdysseyForCausalLM
from model.tokenizer import load_tokenizer
from model.vision import ImagePatches
from rl.config import load_config
from rl.rollout.agent_loop import ChatCodec, EpisodeConfig, run_episode
from rl.warmup import WarmupParams, make_warmup_env, oracle_transcript, pack_batch, sft_loss, train
from tests.scripted_engine import ScriptedEngine

P, MAX_PIXELS = 8, 64 * 64  # the tiny preset's vision settings


@pytest.fixture(scope="module")
def codec() -> ChatCodec:
    return ChatCodec(load_tokenizer(), P, MAX_PIXELS)


def _env(difficulty: int = 0, **kw):
    return envs.make("vision-arith", difficulty=difficulty, use_sandbox=False, **kw)


def _look(env, seed: int) -> tuple[list[dict], list[dict], dict]:
    messages, _ = env.reset(seed=seed)
    obs, _, _, _, info = env.step(env.oracle_actions()[0])
    return messages, obs, info


def _grey(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("L"))


def test_glyph_font_is_one_patch_per_character_and_wraps():
    for text in ("7", "3+4", "(13+20)*7", "0123456789+-*/%()=. "):
        img = _grey(glyphs.render_png(text))
        n = len(text)
        assert img.shape == (8 * -(-n // 8), 8 * min(n, 8))
        for i, ch in enumerate(text):  # each cell holds exactly its glyph (ink = 0, paper = 255)
            cell = img[(i // 8) * 8 : (i // 8) * 8 + 8, (i % 8) * 8 : (i % 8) * 8 + 8]
            want = np.full((8, 8), 255, np.uint8)
            for y, bits in enumerate(glyphs.FONT[ch]):
                for x, b in enumerate(bits):
                    if b == "1":
                        want[y, 1 + x] = 0
            assert np.array_equal(cell, want), (text, i, ch)
    assert glyphs.render_png("12", cell=16) != glyphs.render_png("12")
    assert len({glyphs.FONT[d] for d in "0123456789"}) == 10  # every digit has its own glyph
    with pytest.raises(ValueError, match="cannot render characters"):
        glyphs.render_png("2^3")
    with pytest.raises(ValueError, match="multiple of 8"):
        glyphs.render_png("1", cell=12)


@pytest.mark.parametrize("difficulty", [0, 1, 2, 3])
def test_oracle_solves_every_level_and_the_text_never_holds_the_expression(difficulty):
    env = _env(difficulty)
    assert env.observation_space == ChatMessages(images=True) and env.observation_space != ChatMessages()
    for seed in range(5):
        messages, info = env.reset(seed=seed)
        expr = env.task.expression
        text = "\n".join(m["content"] for m in messages)
        assert expr not in text and env.task.prompt == messages[-1]["content"]
        for a in env.oracle_actions():
            obs, reward, terminated, truncated, step = env.step(a)
            assert env.observation_space.contains(obs)
            assert not step["tool_errors"] and step["infra_error"] is None
            for m in obs:
                if isinstance(m["content"], str):
                    assert expr not in m["content"] or m["content"] == str(env.task.answer)
        assert terminated and reward == 1.0 and step["success"] == 1.0
        assert env.achieved_subgoals == [f"step{i + 1}" for i in range(len(env.task.intermediates))]
    env.close()


def test_the_image_decides_the_answer():
    """Two tasks with the same messages and observations' text need different answers: only the image
    differs, and it is the expression (decoded pixels equal its rendering)."""
    env = _env(0)
    seen: dict[str, tuple] = {}
    for seed in range(40):
        messages, obs, info = _look(env, seed)
        text = [m["content"] for m in messages] + [[p.get("text") for p in obs[0]["content"]]]
        png = obs[0]["content"][1]["image"]
        assert np.array_equal(_grey(png), _grey(glyphs.render_png(env.task.expression)))
        seen.setdefault(repr(text), []).append((env.task.answer, png, seed))
    assert len(seen) == 1  # the text is identical for every task
    (variants,) = seen.values()
    assert len({a for a, _, _ in variants}) >= 10 and len({p for _, p, _ in variants}) >= 10
    a0, png0, s0 = variants[0]
    other = next(v for v in variants if v[0] != a0)
    env.reset(seed=other[2])
    obs, reward, terminated, _, _ = env.step(format_tool_call("answer", {"value": a0}))
    assert terminated and reward == 0.0  # the first task's answer is wrong for the second
    env.close()


def test_blank_images_keep_the_size_and_remove_the_content():
    env, blank = _env(1), _env(1, blank_images=True)
    for seed in range(5):
        _, obs, _ = _look(env, seed)
        _, bobs, _ = _look(blank, seed)
        img, bimg = _grey(obs[0]["content"][1]["image"]), _grey(bobs[0]["content"][1]["image"])
        assert img.shape == bimg.shape and (bimg == 255).all() and (img == 0).any()
        for a in blank.oracle_actions()[1:]:  # the ablation is still a solvable env for a policy that guesses
            *_, info = blank.step(a)
        assert info["success"] == 1.0
    env.close()
    blank.close()


def test_vision_env_config_errors_are_clear():
    with pytest.raises(ValueError, match="vision-arith difficulty must be one of"):
        _env(7)
    with pytest.raises(ValueError, match="unknown vision-arith config field"):
        envs.make("vision-arith", config={"font": 3}, use_sandbox=False)
    with pytest.raises(ValueError, match="multiple of 8"):
        envs.make("vision-arith", config={"cell": 10}, use_sandbox=False)


def test_tool_result_is_refused_by_an_env_that_does_not_observe_images():
    from envs.base import ToolEnv
    from envs.tools import tool

    class TextOnly(ToolEnv):
        def generate_task(self, seed, options):
            return type("T", (), {"task_id": "t", "prompt": "p"})()

        @tool
        def pic(self) -> ToolResult:
            """A picture."""
            return ToolResult("x", [glyphs.render_png("1")])

    env = TextOnly()
    env.reset(seed=0)
    obs, _, _, _, info = env.step('<tool_call>{"name": "pic", "arguments": {}}</tool_call>')
    assert obs[0]["content"].startswith("error: tool 'pic' returned images") and "observes_images" in obs[0][
        "content"]
    with pytest.raises(TypeError, match="encoded image bytes"):
        ToolResult("x", [np.zeros((2, 2))])
    with pytest.raises(TypeError, match="list of encoded images"):
        ToolResult("x", b"\x89PNG")


def test_warmup_transcript_is_the_agent_loop_trajectory_with_its_images(codec):
    env = make_warmup_env("vision-arith", {"difficulty": 1, "max_turns": 5})
    assert not env.uses_sandbox
    tr = oracle_transcript(env, codec, 4)
    assert tr.success == 1.0 and len(tr.images) == 1
    start, pixels = tr.images[0]
    assert int(tr.tokens[start]) == IMAGE_START_ID and pixels.dtype == torch.uint8
    probe = make_warmup_env("vision-arith", {"difficulty": 1, "max_turns": 5})
    probe.reset(seed=4)
    actions = probe.oracle_actions()
    traj = asyncio.run(run_episode(ScriptedEngine(codec, actions), probe, codec, EpisodeConfig(), seed=4))
    assert traj.outcome == 1.0 and traj.infra_error is None
    assert tr.tokens[:-1].tolist() == traj.tokens.tolist()
    (span,) = traj.image_spans
    n = len(env.task.expression)  # one patch per character, 8 per row
    assert span.start == start and (span.grid_h, span.grid_w) == (-(-n // 8), min(n, 8))
    from model.image import decode_prepared

    assert torch.equal(decode_prepared(traj.images[span.sha256], P), pixels)


def test_sft_loss_with_images_equals_a_full_forward_and_depends_on_the_pixels(codec):
    env = make_warmup_env("vision-arith", {"difficulty": 1, "max_turns": 5})
    trs = [oracle_transcript(env, codec, s) for s in (1, 2, 3)]
    torch.manual_seed(0)
    model = OdysseyForCausalLM(OdysseyConfig.from_preset("tiny", balancing="none")).train()
    ids = torch.from_numpy(np.concatenate([t.tokens for t in trs]).astype(np.int64))
    labels = torch.from_numpy(
        np.concatenate([np.where(t.loss_mask == 1, t.tokens, IGNORE_INDEX) for t in trs]).astype(np.int64)
    )
    lens = np.cumsum([0] + [len(t.tokens) for t in trs])
    cu = torch.tensor(lens, dtype=torch.int32)
    images = ImagePatches.from_images([px for t in trs for _, px in t.images],
                                      [int(o) + s for t, o in zip(trs, lens) for s, _ in t.images], P)
    with torch.no_grad():
        ref = float(model(ids, cu_seqlens=cu, labels=labels, images=images).loss)
        blind = float(model(ids, cu_seqlens=cu, labels=labels).loss)
    assert abs(ref - blind) > 1e-4  # the pixels change the loss
    for share in (True, False):
        batch = pack_batch(trs, share_prefix=share, patch_size=P)
        n_patches = sum((px.shape[1] // P) * (px.shape[2] // P) for t in trs for _, px in t.images)
        assert batch.images is not None and batch.images.n == n_patches
        assert (batch.prefix.numel() > 100) == share  # the system prompt is still shared
        with torch.no_grad():
            loss, _ = sft_loss(model, batch)
        assert abs(float(loss) - ref) < 1e-5, (share, float(loss), ref)
    loss, _ = sft_loss(model, pack_batch(trs, patch_size=P))
    loss.backward()
    assert model.model.vision.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="patch size"):
        pack_batch(trs)


def test_short_vision_warmup_lowers_the_loss():
    cfg = load_config("configs/vision_tiny.yaml", [])
    torch.set_num_threads(1)
    res = train(cfg, WarmupParams(steps=12, batch_size=4, log_every=3, warmup_steps=2), log=None)
    nll = [h["nll"] for h in res.history]
    assert nll[-1] < 0.8 * nll[0], nll  # measured: 7.81 -> 5.61 (the 250-step run: docs/vision.md)
    assert res.n_tasks >= 20


@pytest.mark.docker
def test_sandbox_rendering_equals_in_process(sandbox_pool):
    sandboxed = envs.make("vision-arith", difficulty=2, sandbox_pool=sandbox_pool)
    local = _env(2)
    try:
        for seed in (0, 1):
            _, obs, info = _look(sandboxed, seed)
            _, lobs, linfo = _look(local, seed)
            assert info["infra_error"] is None and not info["tool_errors"]
            assert obs == lobs and info["tool_results"] == linfo["tool_results"]
        # the raw PNG bytes written in the sandbox equal the in-process renderer's
        sandboxed.reset(seed=9)
        local.reset(seed=9)
        raw = sandboxed._run(sandboxed.render())
        assert raw == local.task.image() == glyphs.render_png(local.task.expression)
        for a in sandboxed.oracle_actions():
            *_, info = sandboxed.step(a)
        assert info["success"] == 1.0
    finally:
        sandboxed.close()
        local.close()


def test_dataset_rows_with_images_put_the_image_in_the_prompt(tmp_path, codec):
    """dataset-qa with image_field: a path cell and a {"bytes", "path"} cell (HF datasets convention) both
    become an image part before the question; the model sees it (the encoded prompt holds its block), the
    stored row is JSON; rows of a .jsonl file and of a parquet file with image bytes work through
    TaskDataset; bad cells are clear errors."""
    import json

    from envs.dataset import DatasetError, TaskDataset

    png = glyphs.render_png("2+3")
    (tmp_path / "q.png").write_bytes(png)
    rows = [{"prompt": "What is the value?", "answer": "5", "image": str(tmp_path / "q.png")},
            {"prompt": "What is the value?", "answer": "5", "image": {"bytes": png, "path": None}}]
    env = envs.make("dataset-qa", verifier="exact-match", image_field="image")
    assert env.observation_space == ChatMessages(images=True)
    for row in rows:
        messages, _ = env.reset(options={"row": row})
        assert env.observation_space.contains(messages)
        user = messages[-1]["content"]
        assert user[0]["type"] == "image" and user[1] == {"type": "text", "text": "What is the value?"}
        assert np.array_equal(_grey(user[0]["image"]), _grey(png))
        json.dumps(env.task.columns)  # the stored row: the image by its digest
        enc = codec.encode_prompt(messages, None)
        assert len(enc.images) == 1 and enc.images[0][1].grid == (1, 3)
        *_, info = env.step("5")
        assert info["success"] == 1.0
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [rows[0]] * 4))
    data = TaskDataset.load(path, eval_size=1)
    messages, _ = env.reset(options={"row": data.task_row("train", 0)})
    assert messages[-1]["content"][0]["type"] == "image"
    # a parquet file with the HF datasets image struct (binary bytes): rows stay JSON, the image arrives
    import datasets

    datasets.Dataset.from_list([rows[1]] * 3).to_parquet(str(tmp_path / "rows.parquet"))
    data = TaskDataset.load(tmp_path / "rows.parquet", eval_size=1)
    row = data.task_row("train", 0)
    json.dumps(row.to_dict())
    messages, _ = env.reset(options={"row": row})
    assert np.array_equal(_grey(messages[-1]["content"][0]["image"]), _grey(png))
    text_only = envs.make("dataset-qa", verifier="exact-match")
    assert text_only.observation_space == ChatMessages()
    (tmp_path / "bad.png").write_bytes(png[:40])
    for cell, says in [(str(tmp_path / "nope.png"), "cannot read image file"),
                       (str(tmp_path / "bad.png"), "not a format Pillow can decode"),
                       ({"bytes": None, "path": None}, "neither bytes nor a path"),
                       (7, "HF datasets image convention")]:
        with pytest.raises(DatasetError, match=says) as e:
            env.reset(options={"row": {"prompt": "q", "answer": "1", "image": cell}})
        assert "column 'image'" in str(e.value)
