"""Native vision in the model (model/vision.py, model/modeling.py): the token layout, the patch embedding
against an explicit per-pixel reference, and the model with images against the per-sequence, one-pass and
text-only references (tiny preset, fp32)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from model.config import OdysseyConfig
from model.modeling import IGNORE_INDEX, OdysseyForCausalLM
from model.vision import (
    IMAGE_END_ID,
    IMAGE_PAD_ID,
    IMAGE_ROW_BREAK_ID,
    IMAGE_START_ID,
    ImagePatches,
    image_grid,
    image_token_count,
    image_token_ids,
    pad_offsets,
    patchify,
)

P = 8  # tiny preset patch size


@pytest.fixture(scope="module")
def model() -> OdysseyForCausalLM:
    torch.manual_seed(0)
    return OdysseyForCausalLM(OdysseyConfig.from_preset("tiny")).eval()


def seq_with_images(
    gen: torch.Generator, grids: list[tuple[int, int]], n_text: int = 5
) -> tuple[list[int], list[torch.Tensor], list[int]]:
    """Random text, then each image block followed by more text: (ids, pixel tensors, start positions)."""
    ids = torch.randint(100, 4000, (n_text,), generator=gen).tolist()
    images, starts = [], []
    for h, w in grids:
        starts.append(len(ids))
        ids += image_token_ids(h, w)
        images.append(torch.randint(0, 256, (3, h * P, w * P), generator=gen, dtype=torch.uint8))
        ids += torch.randint(100, 4000, (n_text,), generator=gen).tolist()
    return ids, images, starts


# ---- layout ------------------------------------------------------------------------------------------


def test_image_token_layout_is_one_definition():
    for h, w in [(1, 1), (2, 3), (5, 1), (4, 7)]:
        ids = image_token_ids(h, w)
        assert len(ids) == image_token_count(h, w) == h * (w + 1) + 2
        assert ids[0] == IMAGE_START_ID and ids[-1] == IMAGE_END_ID
        pads = [i for i, t in enumerate(ids) if t == IMAGE_PAD_ID]
        assert pads == pad_offsets(h, w).tolist()  # row-major (r, c) -> 1 + r(w+1) + c
        assert [i for i, t in enumerate(ids) if t == IMAGE_ROW_BREAK_ID] == [
            (r + 1) * (w + 1) for r in range(h)
        ]


@pytest.mark.parametrize(
    "H,W",
    [
        (1, 1),
        (7, 9),
        (64, 64),
        (65, 64),
        (480, 640),
        (1, 10_000),
        (10_000, 1),
        (3000, 17),
        (33, 63),
        (4096, 4096),
    ],
)
@pytest.mark.parametrize("max_pixels", [64, 64 * 64, 100 * 100])
def test_image_grid_respects_the_pixel_cap_and_keeps_aspect(H, W, max_pixels):
    h, w = image_grid(H, W, P, max_pixels)
    assert h >= 1 and w >= 1
    assert (h * P) * (w * P) <= max_pixels
    if H % P == 0 and W % P == 0 and H * W <= max_pixels:
        assert (h * P, w * P) == (H, W)  # already a grid size under the cap: unchanged
    s = min(1.0, math.sqrt(max_pixels / (H * W)))
    assert h <= max(1, H * s / P) and w <= max(1, W * s / P)  # never upscaled beyond the cap's scale


def test_image_grid_rejects_bad_input():
    with pytest.raises(ValueError, match="smaller than one 8x8 patch"):
        image_grid(10, 10, 8, 63)
    with pytest.raises(ValueError, match="height must be a positive int"):
        image_grid(0, 10, 8, 4096)


def test_patchify_equals_explicit_pixel_loop():
    g = torch.Generator().manual_seed(1)
    px = torch.rand(3, 2 * P, 3 * P, generator=g)
    patches, pos = patchify(px, P)
    assert patches.shape == (6, 3 * P * P)
    for r in range(2):
        for c in range(3):
            i = r * 3 + c
            assert pos[i].tolist() == [r, c]
            ref = [px[ch, r * P + y, c * P + x] for ch in range(3) for y in range(P) for x in range(P)]
            assert torch.equal(patches[i], torch.stack(ref))
    with pytest.raises(ValueError, match="not a whole number of 8x8 patches"):
        patchify(torch.rand(3, 9, 8), P)


def test_patch_embed_equals_the_formula_in_fp64(model):
    """x = W_p(2P - 1) + b_p + g * [sin(r w), cos(r w), sin(c w), cos(c w)], w_i = 10000^(-i/q), q = D/4."""
    pe = model.model.vision
    D = model.config.hidden_size
    with torch.no_grad():
        pe.pos_gain.copy_(torch.linspace(-1, 1, D))  # a non-trivial gain
        g = torch.Generator().manual_seed(2)
        patches = torch.rand(5, 3 * P * P, generator=g)
        pos = torch.tensor([[0, 0], [0, 3], [2, 1], [7, 0], [31, 63]])
        out = pe(patches, pos)
        W, b, gain = pe.weight.double(), pe.bias.double(), pe.pos_gain.double()
        q = D // 4
        for i in range(5):
            r, c = pos[i].tolist()
            code = (
                [math.sin(r * 10000 ** (-j / q)) for j in range(q)]
                + [math.cos(r * 10000 ** (-j / q)) for j in range(q)]
                + [math.sin(c * 10000 ** (-j / q)) for j in range(q)]
                + [math.cos(c * 10000 ** (-j / q)) for j in range(q)]
            )
            ref = W @ (2 * patches[i].double() - 1) + b + gain * torch.tensor(code, dtype=torch.float64)
            torch.testing.assert_close(out[i].double(), ref, atol=1e-5, rtol=0)
        pe.pos_gain.fill_(model.config.initializer_range)


# ---- the model with images -------------------------------------------------------------------------


def test_patches_replace_exactly_the_pad_embeddings(model):
    g = torch.Generator().manual_seed(3)
    ids, imgs, starts = seq_with_images(g, [(2, 3)])
    ip = ImagePatches.from_images(imgs, starts, P)
    x = model.model.embed(torch.tensor(ids), ip)
    tok = model.model.embed_tokens(torch.tensor(ids))
    pads = set(ip.token_index.tolist())
    assert pads == {starts[0] + o for o in pad_offsets(2, 3).tolist()}
    patches, pos = patchify(imgs[0].float() / 255, P)
    emb = model.model.vision(patches, pos)
    for t in range(len(ids)):
        if t in pads:
            torch.testing.assert_close(x[t], emb[sorted(pads).index(t)], atol=0, rtol=0)
        else:
            assert torch.equal(x[t], tok[t])  # start / row break / end / text: token embeddings


@torch.no_grad()
def test_images_change_only_later_positions(model):
    g = torch.Generator().manual_seed(4)
    ids, imgs, starts = seq_with_images(g, [(2, 2)])
    t = torch.tensor(ids)
    a = model(t, images=ImagePatches.from_images(imgs, starts, P)).logits
    other = [torch.randint(0, 256, im.shape, generator=g, dtype=torch.uint8) for im in imgs]
    b = model(t, images=ImagePatches.from_images(other, starts, P)).logits
    first_pad = starts[0] + 1
    torch.testing.assert_close(a[:first_pad], b[:first_pad], atol=1e-6, rtol=0)  # causal: earlier untouched
    assert (a[first_pad:] - b[first_pad:]).abs().max() > 1e-3  # the pixels reach the logits


@torch.no_grad()
def test_packed_with_images_equals_each_sequence_alone(model):
    """Oracle: every sequence run alone (atol 1e-4 fp32, routed experts identical)."""
    g = torch.Generator().manual_seed(5)
    seqs = [
        seq_with_images(g, [(2, 3)]),
        seq_with_images(g, [], n_text=9),
        seq_with_images(g, [(1, 1), (3, 2)], n_text=3),
        seq_with_images(g, [(4, 4)], n_text=2),
    ]
    ids = torch.tensor([t for s in seqs for t in s[0]])
    lens = [len(s[0]) for s in seqs]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    parts = [ImagePatches.from_images(s[1], s[2], P) for s in seqs]
    packed = model(ids, cu, images=ImagePatches.concat(parts, cu[:-1].tolist()), return_routed_experts=True)
    for i, s in enumerate(seqs):
        alone = model(torch.tensor(s[0]), images=parts[i], return_routed_experts=True)
        sl = slice(int(cu[i]), int(cu[i + 1]))
        torch.testing.assert_close(packed.logits[sl], alone.logits, atol=1e-4, rtol=0)
        assert torch.equal(packed.routed_experts[sl], alone.routed_experts)


@torch.no_grad()
def test_chunked_prefill_through_an_image_and_decode_equal_one_pass(model):
    """Prefill split inside an image block (ImagePatches.window) + token-by-token decode == one forward
    (atol 1e-4)."""
    g = torch.Generator().manual_seed(6)
    ids, imgs, starts = seq_with_images(g, [(3, 3), (1, 2)])
    t = torch.tensor(ids)
    ip = ImagePatches.from_images(imgs, starts, P)
    full = model(t, images=ip).logits
    cut1, cut2 = starts[0] + 6, starts[1] + 2  # inside the first and the second image
    pieces, cache = [], None
    for a, b in [(0, cut1), (cut1, cut2), (cut2, len(ids) - 3)]:
        out = model(t[a:b], images=ip.window(a, b), cache=cache, use_cache=True)
        pieces.append(out.logits)
        cache = out.cache
    for s in range(len(ids) - 3, len(ids)):  # decode steps (text)
        out = model(t[s : s + 1], cache=cache)
        pieces.append(out.logits)
        cache = out.cache
    torch.testing.assert_close(torch.cat(pieces), full, atol=1e-4, rtol=0)


@torch.no_grad()
def test_token_logprobs_and_replay_with_images(model):
    g = torch.Generator().manual_seed(7)
    ids, imgs, starts = seq_with_images(g, [(2, 2)])
    t = torch.tensor(ids)
    ip = ImagePatches.from_images(imgs, starts, P)
    out = model(t, images=ip, return_routed_experts=True)
    targets = torch.roll(t, -1)
    ref = torch.log_softmax(out.logits.float(), -1).gather(-1, targets[:, None]).squeeze(-1)
    lp = model.token_logprobs(t, targets, images=ip, chunk_size=7)
    torch.testing.assert_close(lp, ref, atol=1e-5, rtol=0)
    replayed = model(t, images=ip, replay_experts=out.routed_experts, return_routed_experts=True)
    assert torch.equal(replayed.routed_experts, out.routed_experts)  # image tokens are replayed too
    torch.testing.assert_close(replayed.logits, out.logits, atol=0, rtol=0)


def test_image_tokens_carry_no_lm_loss_and_pixels_get_gradients(model):
    g = torch.Generator().manual_seed(8)
    ids, imgs, starts = seq_with_images(g, [(2, 3)])
    t = torch.tensor(ids)
    ip = ImagePatches.from_images(imgs, starts, P)
    model.zero_grad()
    out = model(t, images=ip, labels=t)
    targets = torch.cat([t[1:], torch.tensor([IGNORE_INDEX])])
    targets[
        torch.isin(targets, torch.tensor([IMAGE_START_ID, IMAGE_PAD_ID, IMAGE_ROW_BREAK_ID, IMAGE_END_ID]))
    ] = IGNORE_INDEX
    ref = F.cross_entropy(out.logits.float(), targets, ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(out.loss, ref, atol=1e-6, rtol=0)
    out.loss.backward()
    assert model.model.vision.weight.grad.abs().sum() > 0  # text after the image trains the patch path
    assert model.model.vision.pos_gain.grad.abs().sum() > 0
    model.zero_grad()


def test_save_load_keeps_the_vision_weights(model, tmp_path):
    g = torch.Generator().manual_seed(9)
    ids, imgs, starts = seq_with_images(g, [(2, 2)])
    ip = ImagePatches.from_images(imgs, starts, P)
    model.save_pretrained(tmp_path)
    back = OdysseyForCausalLM.from_pretrained(tmp_path).eval()
    assert back.config.vision_patch_size == P and back.config.vision_max_pixels == 64 * 64
    for k, v in model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    with torch.no_grad():
        assert torch.equal(
            back(torch.tensor(ids), images=ip).logits, model(torch.tensor(ids), images=ip).logits
        )


def test_bad_image_inputs_fail_clearly(model):
    g = torch.Generator().manual_seed(10)
    ids, imgs, starts = seq_with_images(g, [(2, 2)])
    t = torch.tensor(ids)
    with pytest.raises(ValueError, match="not <\\|image_pad\\|>"):
        model(t, images=ImagePatches.from_images(imgs, [starts[0] - 1], P))
    with pytest.raises(ValueError, match="3·p²"):
        model(t, images=ImagePatches.from_images([im[:, :4, :4] for im in imgs], starts, 4))
    with pytest.raises(ValueError, match="ImagePatches"):
        model(t, images=imgs)
    text_only = OdysseyForCausalLM(OdysseyConfig.from_preset("tiny", vision_patch_size=0))
    assert text_only.model.vision is None
    with pytest.raises(ValueError, match="text-only"):
        text_only(t, images=ImagePatches.from_images(imgs, starts, P))


def test_config_vision_fields():
    for name, p in [("tiny", 8), ("small", 16), ("k3", 16)]:
        assert OdysseyConfig.from_preset(name).vision_patch_size == p
    with pytest.raises(Exception, match="smaller than one 8x8 patch"):  # huggingface_hub's validation error
        OdysseyConfig.from_preset("tiny", vision_max_pixels=10)
    with pytest.raises(ValueError, match="reserved ViT-tower fields are gone"):
        OdysseyConfig.from_preset("tiny", vision_num_layers=2)
    # a config.json written before vision (reserved fields at their defaults, vision_patch_size=14) loads as
    # the text-only model it was: no patch embedding, so its checkpoint's state dict matches exactly
    old = OdysseyConfig(
        vision_hidden_size=0,
        vision_num_layers=0,
        vision_num_heads=0,
        vision_patch_size=14,
        image_token_id=None,
    )
    assert "vision_hidden_size" not in old.to_dict() and old.vision_patch_size == 0


def test_text_parameters_draw_the_same_values_as_a_text_only_model():
    """The patch embedding is built and initialised without advancing the global RNG: a seeded vision model's
    other parameters are bit-identical to the text-only model's (existing seeded runs keep their weights)."""
    torch.manual_seed(0)
    text = OdysseyForCausalLM(OdysseyConfig.from_preset("tiny", vision_patch_size=0)).state_dict()
    torch.manual_seed(0)
    vis = OdysseyForCausalLM(OdysseyConfig.from_preset("tiny")).state_dict()
    assert sorted(set(vis) - set(text)) == [
        "model.vision.bias",
        "model.vision.pos_gain",
        "model.vision.weight",
    ]
    assert all(torch.equal(text[k], vis[k]) for k in text)


@torch.no_grad()
def test_bf16_forward_with_images_is_finite_and_close_to_fp32(model):
    """bf16 weights, fp32 routing replayed (as tests/test_modeling.py's bf16 test): the patch embedding runs
    in the weights' dtype; logits stay finite and close to fp32 (cosine > 0.98; measured 0.9994)."""
    g = torch.Generator().manual_seed(11)
    ids, imgs, starts = seq_with_images(g, [(3, 4), (2, 2)])
    t, ip = torch.tensor(ids), ImagePatches.from_images(imgs, starts, P)
    ref = model(t, images=ip, return_routed_experts=True)
    bf = OdysseyForCausalLM(model.config).eval()
    bf.load_state_dict(model.state_dict())
    bf.to(torch.bfloat16)
    out = bf(t, images=ip, replay_experts=ref.routed_experts).logits.float()
    assert torch.isfinite(out).all()
    assert F.cosine_similarity(out.flatten(), ref.logits.flatten(), dim=0) > 0.98


def test_parameter_count_of_the_patch_embedding():
    """`model.count` reports the patch embedding as its own component: 3p²·D + 2D (W_p, b_p, g), active for
    every image token; k3 (p=16, D=7168) on the meta device, tiny against a real model's numel."""
    from model.count import count_parameters

    k3 = count_parameters(OdysseyConfig.from_preset("k3"))
    assert k3.breakdown["vision"].total == k3.breakdown["vision"].active == 3 * 16 * 16 * 7168 + 2 * 7168
    tiny = OdysseyForCausalLM(OdysseyConfig.from_preset("tiny"))
    n = sum(p.numel() for p in tiny.model.vision.parameters())
    assert count_parameters(tiny.config).breakdown["vision"].total == n == 3 * 8 * 8 * 128 + 2 * 128
