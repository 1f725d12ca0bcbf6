"""Image content parts in the chat template and tokenizer (model/tokenizer.py, model/image.py): images expand
to the block model.vision defines, the rollout's continuation invariant holds with images, and text-only
encodings are identical, id for id, to the tokenizer before vision (tests/fixtures/, generated from commit
990ca6c by tests/fixtures/make_tokenizer_text_regression.py)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from model.image import ImageError, decode_prepared, encode_png, prepare_image
from model.tokenizer import (
    IMAGE_TOKENS,
    encode_chat,
    encode_chat_images,
    encode_continuation,
    encode_continuation_images,
    encode_text,
    image_token_ids_of,
    load_tokenizer,
    render_chat,
)
from model.vision import IMAGE_TOKEN_IDS, image_grid, image_token_count, image_token_ids

FIXTURE = Path(__file__).parent / "fixtures" / "tokenizer_text_regression.json"
P, MAX_PIXELS = 8, 64 * 64


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def rgb(h: int, w: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


# ---- text-only behaviour is unchanged ----------------------------------------------------------------


def test_text_only_encodings_equal_the_pre_vision_tokenizer(tok):
    ref = json.loads(FIXTURE.read_text())
    for case in ref["encode"]:
        assert tok.encode(case["text"], add_special_tokens=False) == case["ids"], case["text"]
    for case in ref["encode_text"]:
        assert encode_text(tok, case["text"]) == case["ids"], case["text"]
    for case in ref["decode_skip_special"]:
        assert tok.decode(case["ids"], skip_special_tokens=True) == case["text"]
    for case in ref["encode_chat"]:
        assert encode_chat(tok, case["messages"], case["tools"], case["add_generation_prompt"]) == case["ids"]
    for case in ref["encode_continuation"]:
        assert encode_continuation(tok, case["messages"]) == case["ids"]
    assert len(ref["encode"]) == 160 and len(ref["encode_chat"]) == 60  # the fixture is not empty


def test_image_tokens_are_the_four_former_reserved_ids(tok):
    assert image_token_ids_of(tok) == list(IMAGE_TOKEN_IDS) == [12, 13, 14, 15]
    assert set(IMAGE_TOKENS) <= set(tok.all_special_tokens)  # dropped by decode(skip_special_tokens=True)


# ---- images in messages --------------------------------------------------------------------------------


def test_image_part_expands_to_its_block(tok):
    img = prepare_image(rgb(20, 30, 0), P, MAX_PIXELS)
    assert img.grid == image_grid(20, 30, P, MAX_PIXELS) == (2, 3)
    msgs = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is in"},
                {"type": "image", "image": img},
                {"type": "text", "text": " this?"},
            ],
        }
    ]
    enc = encode_chat_images(tok, msgs, add_generation_prompt=True)
    ((start, placed),) = enc.images
    assert placed is img
    block = image_token_ids(2, 3)
    assert enc.ids[start : start + len(block)] == block and len(block) == image_token_count(2, 3) == 10
    # everything around the block is the text-only encoding of the same message without the image
    text_only = encode_chat(
        tok, [{"role": "user", "content": "What is in this?"}], add_generation_prompt=True
    )
    assert enc.ids[:start] + enc.ids[start + len(block) :] == text_only
    assert encode_chat(tok, msgs, add_generation_prompt=True) == enc.ids
    assert render_chat(tok, msgs) == (
        "<|bos|><|im_start|>user\nWhat is in<|image_start|><|image_pad|><|image_end|> this?<|im_end|>\n"
    )


def test_continuation_invariant_with_images_in_tool_observations(tok):
    """encode_chat(conv + [assistant(c)] + new) == encode_chat(conv, gen) + encode(c) + [END] + continuation,
    with images in the prompt and in the new tool message; image positions shift by the prefix length."""
    a, b = prepare_image(rgb(16, 16, 1), P, MAX_PIXELS), prepare_image(rgb(64, 8, 2), P, MAX_PIXELS)
    conv = [
        {"role": "user", "content": [{"type": "image", "image": a}, {"type": "text", "text": "Describe."}]}
    ]
    c = '<tool_call>{"name": "zoom", "arguments": {}}</tool_call>'
    new = [{"role": "tool", "content": [{"type": "text", "text": "zoomed:"}, {"type": "image", "image": b}]}]
    full = encode_chat_images(
        tok, conv + [{"role": "assistant", "content": c}] + new, add_generation_prompt=True
    )
    head = encode_chat_images(tok, conv, add_generation_prompt=True)
    cont = encode_continuation_images(tok, new)
    body = tok.encode(c, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    assert full.ids == head.ids + body + cont.ids
    off = len(head.ids) + len(body)
    assert [s for s, _ in full.images] == [s for s, _ in head.images] + [s + off for s, _ in cont.images]
    assert [i.sha256 for _, i in full.images] == [a.sha256, b.sha256]


def test_image_strings_in_text_stay_text(tok):
    """Text that spells an image token is bytes, never an image block (no forged images from a tool)."""
    msgs = [{"role": "tool", "content": "<|image_start|><|image_pad|><|image_end|>"}]
    enc = encode_chat_images(tok, msgs)
    assert enc.images == [] and not set(IMAGE_TOKEN_IDS) & set(enc.ids)


@pytest.mark.parametrize(
    "messages, match",
    [
        ([{"role": "user", "content": [{"type": "image"}]}], "image part must be"),
        ([{"role": "user", "content": [{"type": "image", "image": b"\x89PNG"}]}], "prepare_image"),
        ([{"role": "assistant", "content": [{"type": "image", "image": None}]}], "policy writes text only"),
    ],
)
def test_bad_image_parts_fail_clearly(tok, messages, match):
    with pytest.raises(ValueError, match=match):
        encode_chat(tok, messages)


# ---- prepare / decode ----------------------------------------------------------------------------------


def png_bytes(arr: np.ndarray, mode: str) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(arr).convert(mode).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "LA", "P", "1"])
def test_prepare_decodes_modes_resizes_and_round_trips(mode):
    img = prepare_image(png_bytes(rgb(50, 70, 3), mode), P, MAX_PIXELS)
    h, w = img.grid
    assert img.pixels.shape == (3, h * P, w * P) and img.pixels.dtype == torch.uint8
    assert (h * P) * (w * P) <= MAX_PIXELS
    assert torch.equal(decode_prepared(img.png, P, img.grid, img.sha256), img.pixels)  # lossless, exact
    assert prepare_image(img.png, P, MAX_PIXELS).sha256 == img.sha256  # preparing twice changes nothing


def test_prepare_is_exact_for_grid_sized_input():
    arr = rgb(16, 24, 4)
    img = prepare_image(arr, P, MAX_PIXELS)
    assert torch.equal(img.pixels, torch.from_numpy(arr).permute(2, 0, 1))  # no resize, no colour change


def test_bad_images_fail_clearly():
    with pytest.raises(ImageError, match="not a format Pillow can decode"):
        prepare_image(b"not an image", P, MAX_PIXELS)
    with pytest.raises(ImageError, match="allowed before resizing"):
        prepare_image(png_bytes(rgb(64, 64, 5), "RGB"), P, MAX_PIXELS, max_input_pixels=1000)
    with pytest.raises(ImageError, match="mode 'CMYK' is not supported"):
        from PIL import Image

        prepare_image(Image.fromarray(rgb(8, 8, 6)).convert("CMYK"), P, MAX_PIXELS)
    img = prepare_image(rgb(16, 16, 7), P, MAX_PIXELS)
    with pytest.raises(ImageError, match="content address"):
        decode_prepared(img.png, P, img.grid, "0" * 64)
    with pytest.raises(ImageError, match="record says"):
        decode_prepared(img.png, P, (1, 2), img.sha256)
    with pytest.raises(ImageError, match="whole number"):
        decode_prepared(encode_png(torch.zeros(3, 9, 8, dtype=torch.uint8)), P)


def test_text_only_tokenizing_does_not_load_torch():
    """model.tokenizer imports the image layout (pure Python) only, as before vision: no torch for text.
    (Pillow is loaded by transformers itself, with or without vision.)"""
    import subprocess
    import sys

    code = (
        "import sys, model.tokenizer as t; tok = t.load_tokenizer(); "
        "t.encode_chat(tok, [{'role': 'user', 'content': 'hi'}]); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert out.stdout.strip() == "False", out.stdout + out.stderr
