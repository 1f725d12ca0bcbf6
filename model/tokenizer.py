"""Odyssey's tokenizer: a small byte-level BPE with a ChatML-style chat template and tool-call tokens.

Built deterministically with `tokenizers` from the text corpus shipped in `model/assets/corpus/`, and saved as
a `transformers.PreTrainedTokenizerFast` in `model/assets/tokenizer/` (committed; rebuild with
`python -m model.tokenizer build`, check with `python -m model.tokenizer build --check`).

Vocabulary (ids are stable: specials first, then the 256 byte symbols, then merges; total <= 4096):

    special (dropped by decode(skip_special_tokens=True)):
        0 <|pad|>   1 <|bos|>   2 <|eos|>   3 <|im_start|>   4 <|im_end|>
    markup (added tokens that are NOT special, so decoded text keeps them and tool calls survive):
        5 <tool_call>   6 </tool_call>   7 <tool_response>   8 </tool_response>
        9 <image>   10 <think>   11 </think>
    image (special; the four slots reserved before vision, so no other id moved; model/vision.py):
        12 <|image_start|>   13 <|image_pad|>   14 <|image_row_break|>   15 <|image_end|>

Every byte is in the vocabulary, so there is no UNK token and `decode(encode(s)) == s` for any string
(decode with `skip_special_tokens=False` when `s` itself contains special-token text).

Pre-tokenization: (1) every "\\n" is its own piece, (2) a GPT-4-like regex splits the rest with digits one by
one (so arithmetic never sees multi-digit merges), (3) bytes are mapped to the GPT-2 byte alphabet.
Because no regex branch crosses a newline and special tokens are cut out before any of this, the text
between two turn boundaries (a newline or a special token) is tokenized exactly as it would be on its own.

Chat format (the template in `CHAT_TEMPLATE`; messages are {"role": "system"|"user"|"assistant"|"tool",
"content": str | None | [{"type": "text", "text": ...} | {"type": "image", "image": PreparedImage}]}):

    <|bos|>                                                        once, at the very start
    <|im_start|>system\\n{system}\\n\\n# Tools ...<tools>\\n{schema}...</tools>...<|im_end|>\\n   with tools
    <|im_start|>system\\n{content}<|im_end|>\\n
    <|im_start|>user\\n{content}<|im_end|>\\n
    <|im_start|>assistant\\n{content}<|im_end|>\\n                    content verbatim, tool calls
                                                                   inline as <tool_call>{json}</tool_call>
    <|im_start|>tool\\n<tool_response>{content}</tool_response><|im_end|>\\n
    <|im_start|>assistant\\n                                          generation prompt

Tool calls inside assistant content: <tool_call>{"name": <tool-name>, "arguments": {...}}</tool_call>.

The model's turn ends with END_OF_TURN ("<|im_end|>"); the newline after it belongs to the next piece of
the conversation. Invariant the rollout relies on (tested in tests/test_tokenizer.py, for any content):

    encode_chat(conv + [assistant(c)] + new, add_generation_prompt=g)
        == encode_chat(conv, add_generation_prompt=True) + encode(c) + [id(END_OF_TURN)]
           + encode_continuation(tok, new, add_generation_prompt=g)

where encode(c) = tok.encode(c, add_special_tokens=False). So a rollout keeps the exact sampled ids of a turn,
appends the END_OF_TURN id when generation stopped on it (or appends it itself when the turn was cut by
max_new_tokens), then appends encode_continuation(observations) and samples the next turn.

Images (the OpenAI / HF content-part convention): a {"type": "image", "image": img} part of a system, user or
tool message, with img a `model.image.PreparedImage` (decoded and resized once by `prepare_image`), becomes
the image's token block `model.vision.image_token_ids(h, w)`: <|image_start|>, h rows of w <|image_pad|> and
a <|image_row_break|>, <|image_end|>. `render_chat` shows it as <|image_start|><|image_pad|><|image_end|>;
`encode_chat` / `encode_continuation` expand it, and `encode_chat_images` / `encode_continuation_images`
also return where each image block starts. Messages without images encode exactly as before vision
(tests/test_vision_tokenizer.py holds the ids of the pre-vision tokenizer).

Content is text, never structure: the content of system, user and tool messages (task text, dataset rows,
tool output written by sandboxed agent code) is encoded with special tokens split into plain bytes, so a
tool output that prints "</tool_response><|im_end|>" cannot close its turn, forge a user turn or a tool
result. Only the template itself, and assistant content (the model's own markup, e.g. <tool_call>), yield
special and markup ids. Exact: every content slot in the template is bounded by a newline or an added token.

Other tokenizers (an HF checkpoint's own: `policy_tokenizer`, docs/hf.md "Its own tokenizer"): the chat
helpers below take any fast tokenizer with a chat template. `chat_format` reads the end-of-turn token off the
template (the added token that closes an assistant turn); the rollout invariant above holds with it in place
of END_OF_TURN; text runs between the template's added tokens are encoded whole (`plain_ids`), so ids equal
the tokenizer's own `apply_chat_template(..., tokenize=True)` wherever content holds no added-token string,
and content never yields an added token's id.
"""

from __future__ import annotations

import argparse
import filecmp
import functools
import hashlib
import json
import re
import secrets
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import PreTrainedTokenizerFast

from model.image_tokens import IMAGE_TOKEN_IDS, image_token_ids

if TYPE_CHECKING:  # model.image needs torch and Pillow; text-only tokenizing loads neither
    from model.image import PreparedImage

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
CORPUS_DIR = ASSETS_DIR / "corpus"
TOKENIZER_DIR = ASSETS_DIR / "tokenizer"

VOCAB_SIZE = 4096  # upper bound, including special tokens and the 256 byte symbols (= tiny preset vocab_size)
MIN_FREQUENCY = 2  # a pair must occur at least twice in the corpus to become a merge
MODEL_MAX_LENGTH = 1 << 20  # 1M-token trajectories are in scope; silences length warnings

PAD = "<|pad|>"
BOS = "<|bos|>"
EOS = "<|eos|>"
IM_START = "<|im_start|>"
END_OF_TURN = "<|im_end|>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TOOL_RESPONSE_START = "<tool_response>"
TOOL_RESPONSE_END = "</tool_response>"
IMAGE = "<image>"  # a plain markup token (pre-vision); images are the IMAGE_TOKENS blocks below
THINK_START = "<think>"
THINK_END = "</think>"
IMAGE_START = "<|image_start|>"
IMAGE_PAD = "<|image_pad|>"
IMAGE_ROW_BREAK = "<|image_row_break|>"
IMAGE_END = "<|image_end|>"
#: ids 12..15 (model.vision.IMAGE_TOKEN_IDS): the slots that were <|reserved_0|>..<|reserved_3|>
IMAGE_TOKENS = [IMAGE_START, IMAGE_PAD, IMAGE_ROW_BREAK, IMAGE_END]

#: Control tokens: dropped by decode(skip_special_tokens=True).
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, END_OF_TURN]
#: Single-id markup tokens that stay visible in decoded text (the env parses tool calls from it).
MARKUP_TOKENS = [
    TOOL_CALL_START,
    TOOL_CALL_END,
    TOOL_RESPONSE_START,
    TOOL_RESPONSE_END,
    IMAGE,
    THINK_START,
    THINK_END,
]
ALL_ADDED_TOKENS = SPECIAL_TOKENS + MARKUP_TOKENS + IMAGE_TOKENS

#: Split pattern applied after newlines have been isolated. Contractions, words with one optional leading
#: non-letter (" the", ".py"), single digits, punctuation runs, whitespace. No branch can match "\n".
SPLIT_PATTERN = r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"

ROLES = ("system", "user", "assistant", "tool")

# Jinja, rendered by transformers' sandboxed environment. Every tag strips the whitespace around it and
# every literal is a string expression, so the layout below never leaks into the output and content is
# emitted verbatim (no trimming: the assistant-turn invariant depends on it).
CHAT_TEMPLATE = r"""
{%- macro render_content(content) -%}
    {%- if content is none -%}
    {%- elif content is string -%}{{- content -}}
    {%- else -%}
        {%- for part in content -%}
            {%- if part['type'] == 'text' -%}{{- part['text'] -}}
            {%- elif part['type'] == 'image' -%}{{- '<|image_start|><|image_pad|><|image_end|>' -}}
            {%- else -%}{{- raise_exception('unsupported content part type ' ~ part['type'] ~ ' (use text or image)') -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{{- bos_token -}}
{%- set ns = namespace(start=0) -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if messages and messages[0]['role'] == 'system' -%}
        {{- render_content(messages[0]['content']) + '\n\n' -}}
        {%- set ns.start = 1 -%}
    {%- endif -%}
    {{- '# Tools\n\nYou may call one or more tools. Their signatures are JSON schemas within <tools></tools>:\n<tools>' -}}
    {%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
    {{- '\n</tools>\n\nTo call a tool, write a JSON object with the tool name and its arguments within <tool_call></tool_call> tags:\n' -}}
    {{- '<tool_call>{"name": <tool-name>, "arguments": <args-json-object>}</tool_call>\n' -}}
    {{- 'Each result comes back as a tool message within <tool_response></tool_response> tags.<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages[ns.start:] -%}
    {%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] -%}
        {{- raise_exception('unknown chat role ' ~ message['role'] ~ ' (use system, user, assistant or tool)') -}}
    {%- endif -%}
    {%- if message.get('tool_calls') -%}
        {{- raise_exception('the tool_calls field is not supported: put tool calls inline in the assistant content as <tool_call>{...}</tool_call>') -}}
    {%- endif -%}
    {%- if message['role'] == 'tool' -%}
        {{- '<|im_start|>tool\n<tool_response>' + render_content(message['content']) + '</tool_response><|im_end|>\n' -}}
    {%- else -%}
        {{- '<|im_start|>' + message['role'] + '\n' + render_content(message['content']) + '<|im_end|>\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
""".strip()  # noqa: E501



# ---------------------------------------------------------------------------------------------------------
# Building
# ---------------------------------------------------------------------------------------------------------


def _corpus_texts(corpus_dir: Path) -> list[str]:
    """Corpus files' text, cut at added-token strings (those are single ids; merges must not span them)."""
    files = sorted(corpus_dir.glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no *.txt corpus files in {corpus_dir}; the corpus ships with the repo")
    cut = re.compile("|".join(re.escape(t) for t in ALL_ADDED_TOKENS))
    return [piece for f in files for piece in cut.split(f.read_text(encoding="utf-8")) if piece]


def build_tokenizer(out_dir: Path | str = TOKENIZER_DIR, corpus_dir: Path | str = CORPUS_DIR) -> Path:
    """Train the byte-level BPE on `corpus_dir/*.txt` and save a PreTrainedTokenizerFast to `out_dir`.

    Deterministic: the same corpus gives byte-identical files (BPE merge ties are broken by pair id).
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    out_dir, corpus_dir = Path(out_dir), Path(corpus_dir)
    texts = _corpus_texts(corpus_dir)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\n"), behavior="isolated"),
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=MIN_FREQUENCY,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in ALL_ADDED_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)

    # The trainer registers every added token as special; markup tokens must survive
    # decode(skip_special_tokens=True), so flip their flag in the serialized form.
    state = json.loads(tok.to_str())
    for entry in state["added_tokens"]:
        entry["special"] = entry["content"] not in MARKUP_TOKENS
    tok = Tokenizer.from_str(json.dumps(state))

    vocab = tok.get_vocab_size(with_added_tokens=True)
    if vocab > VOCAB_SIZE:
        raise AssertionError(f"vocab {vocab} exceeds {VOCAB_SIZE}")
    for i, t in enumerate(ALL_ADDED_TOKENS):
        if tok.token_to_id(t) != i:
            raise AssertionError(f"added token {t} got id {tok.token_to_id(t)}, expected {i}")
    if [tok.token_to_id(t) for t in IMAGE_TOKENS] != list(IMAGE_TOKEN_IDS):
        raise AssertionError(f"image token ids differ from model.vision.IMAGE_TOKEN_IDS {IMAGE_TOKEN_IDS}")

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        extra_special_tokens=[IM_START, END_OF_TURN, *IMAGE_TOKENS],
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out_dir))
    return out_dir


@functools.lru_cache(maxsize=4)
def load_tokenizer(path: str | None = None) -> PreTrainedTokenizerFast:
    """Load the shipped tokenizer (cached: treat the returned object as read-only; deepcopy to modify)."""
    path = Path(path) if path is not None else TOKENIZER_DIR
    if not (path / "tokenizer.json").exists():
        raise FileNotFoundError(f"no tokenizer.json in {path}; build it: `python -m model.tokenizer build`")
    tok = PreTrainedTokenizerFast.from_pretrained(str(path))
    if tok.chat_template is None:
        raise ValueError(f"{path} has no chat template; rebuild it with `python -m model.tokenizer build`")
    return tok


def policy_tokenizer(checkpoint: str | Path | None = None) -> PreTrainedTokenizerFast:
    """The tokenizer of the policy that loads from `checkpoint` (model.hf_path or model.init_from).

    An HF causal LM checkpoint (not Odyssey's model_type) that ships a tokenizer (tokenizer.json beside
    config.json, as `tokenizer.save_pretrained` writes it) brings its own: its vocabulary and its chat
    template, checked by `chat_format`. Anything else (a fresh preset, an Odyssey checkpoint, an HF
    checkpoint without tokenizer files) uses Odyssey's shipped tokenizer. docs/hf.md "Its own tokenizer".
    """
    if checkpoint is None:
        return load_tokenizer()
    path = Path(checkpoint).expanduser()
    try:
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        model_type = None  # the config checks name an unreadable checkpoint
    if model_type == "odyssey_moe" or not (path / "tokenizer.json").is_file():
        return load_tokenizer()
    return _checkpoint_tokenizer(str(path.resolve()))


@functools.lru_cache(maxsize=4)
def _checkpoint_tokenizer(path: str) -> PreTrainedTokenizerFast:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds; all mean the same to the user
        raise ValueError(f"{path}: its tokenizer does not load ({type(e).__name__}: {e}); fix or remove the "
                         "tokenizer files (without them the policy uses Odyssey's tokenizer)") from e
    if not tok.is_fast:
        raise ValueError(f"{path}: the tokenizer is a slow (Python) tokenizer; save a fast one "
                         "(tokenizer.json, e.g. AutoTokenizer.from_pretrained(..., use_fast=True)"
                         ".save_pretrained(dir))")
    chat_format(tok)  # a usable chat template, or a clear error now rather than in a rollout worker
    return tok


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerFast) -> str:
    """16 hex digits of sha256 over the tokenizer's whole definition (vocabulary, merges, added tokens,
    normaliser, pre-tokeniser): equal fingerprints mean the same text <-> id mapping. Trajectories record it
    (metadata["tokenizer"]) so a learner with another tokenizer refuses them."""
    return hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------------------
# Chat helpers (the rollout uses these; see the invariant in the module docstring)
# ---------------------------------------------------------------------------------------------------------


def _check_messages(messages: Sequence[dict[str, Any]]) -> None:
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {m!r}")
        if m["role"] not in ROLES:
            raise ValueError(f"message {i} has unknown role {m['role']!r}; use one of {', '.join(ROLES)}")
        content = m.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "image"):
                continue
            from model.image import PreparedImage

            if m["role"] == "assistant":
                raise ValueError(f"message {i} (assistant) holds an image part; the policy writes text only: "
                                 "put images in system, user or tool messages")
            if not isinstance(part.get("image"), PreparedImage):
                got = type(part.get("image")).__name__
                raise ValueError(f"message {i}: an image part must be {{'type': 'image', 'image': img}} with "
                                 "img from model.image.prepare_image(...) (decoded and sized to its patch "
                                 f"grid), got image={got}")


@dataclass
class ChatEncoding:
    """Token ids of a conversation and its images: images[j] = (index in ids of the j-th image block's
    <|image_start|> token, the PreparedImage); the block is model.vision.image_token_ids(*image.grid)."""

    ids: list[int]
    images: list[tuple[int, PreparedImage]] = field(default_factory=list)


def render_chat(
    tokenizer: PreTrainedTokenizerFast,
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None = None,
    add_generation_prompt: bool = False,
) -> str:
    """The chat template applied to `messages` (and tool JSON schemas), as text."""
    _check_messages(messages)
    return tokenizer.apply_chat_template(
        list(messages),
        tools=list(tools) if tools else None,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
    )


def _slotted(messages: Sequence[dict[str, Any]]
             ) -> tuple[list[dict[str, Any]], list[str | PreparedImage], re.Pattern]:
    """Messages whose non-assistant text content and images are replaced by numbered slot markers, the slots'
    contents (texts and images), and the markers' pattern. Markers carry a fresh random nonce, so no text
    (assistant content, a tool schema) can contain one."""
    texts: list[str | PreparedImage] = []
    nonce = secrets.token_hex(8)

    def slot(text: str | PreparedImage) -> str:
        texts.append(text)
        return f"\ue000{nonce}:{len(texts) - 1}\ue001"

    out = []
    for m in messages:
        content = m.get("content")
        if m.get("role") == "assistant" or not content:
            out.append(m)
        elif isinstance(content, str):
            out.append({**m, "content": slot(content)})
        elif isinstance(content, list):
            parts = []
            for p in content:
                kind = p.get("type") if isinstance(p, dict) else None
                if kind == "text" and isinstance(p.get("text"), str) and p["text"]:
                    p = {**p, "text": slot(p["text"])}
                elif kind == "image":
                    p = {"type": "text", "text": slot(p["image"])}
                parts.append(p)
            out.append({**m, "content": parts})
        else:
            out.append(m)
    return out, texts, re.compile(f"\ue000{nonce}:(\\d+)\ue001")


def _after_assistant_turn(tokenizer: PreTrainedTokenizerFast, following: list[dict[str, Any]],
                          add_generation_prompt: bool = False) -> str | None:
    """What the template renders right after an assistant turn's content, with `following` messages after
    that turn (a user turn and an assistant turn whose content is a nonce stand in for the conversation so
    far); None when the template drops the assistant's content."""
    nonce = f"\ue000{secrets.token_hex(8)}\ue001"
    turns = [{"role": "user", "content": "."}, {"role": "assistant", "content": nonce}, *following]
    text = render_chat(tokenizer, turns, add_generation_prompt=add_generation_prompt)
    return text[text.index(nonce) + len(nonce):] if nonce in text else None


@dataclass(frozen=True)
class ChatFormat:
    """What the rollout reads from a tokenizer's chat template (Odyssey's or a checkpoint's own).

    end_of_turn: the added token that closes an assistant turn ("<|im_end|>" in Odyssey's and Qwen's
    templates, "<|eot_id|>" in Llama 3's); sampling stops on it and a cut turn gets it appended.
    added: every added-token string of the vocabulary, longest first (content never yields their ids).
    slot_exact: True for Odyssey's tokenizer, whose template bounds every content slot by an added token or
    a newline its pre-tokenizer isolates, so content encodes on its own exactly as inside the whole text.
    Other tokenizers' pre-tokenizers merge across those edges (Qwen's attaches ".\n\n" into one piece), so
    their chats are encoded run by run: the text between two of the template's added tokens, content
    included, goes through the tokenizer's pipeline without added-token matching (`plain_ids`), which is
    the tokenizer's own encoding of the rendered text wherever content holds no added-token string.
    """

    end_of_turn: str
    added: re.Pattern
    slot_exact: bool


@functools.lru_cache(maxsize=16)
def chat_format(tokenizer: PreTrainedTokenizerFast) -> ChatFormat:
    """The `ChatFormat` of `tokenizer`, read off its chat template by rendering a user turn and an assistant
    turn whose content is a nonce: the first added token after the nonce is the end of turn. Raises a
    ValueError naming the problem when the template cannot drive a rollout."""
    added = sorted(tokenizer.get_added_vocab(), key=len, reverse=True)
    if not added:
        raise ValueError("the tokenizer has no added tokens, so its chat template cannot mark the end of an "
                         "assistant turn; use a tokenizer with a chat template built on special tokens")
    pattern = re.compile("|".join(re.escape(t) for t in added))
    if tokenizer.chat_template is None:
        raise ValueError("the tokenizer has no chat template; save the model's tokenizer with its template "
                         "(tokenizer.chat_template) or remove it to use Odyssey's tokenizer")
    try:
        after = _after_assistant_turn(tokenizer, [])
    except Exception as e:  # noqa: BLE001 - a template raises whatever its author wrote
        raise ValueError(f"the chat template fails on a user turn and an assistant turn ({type(e).__name__}: "
                         f"{e}); Odyssey renders system, user, assistant and tool messages with it") from e
    if after is None:
        raise ValueError("the chat template drops an assistant turn's content; Odyssey needs a template that "
                         "renders it verbatim")
    m = pattern.match(after)
    if m is None:
        raise ValueError(f"the chat template closes an assistant turn with {after[:40]!r}, not with an added "
                         "token; Odyssey stops sampling on that token, so the template must end each "
                         "assistant turn with one (as <|im_end|> or <|eot_id|> do)")
    shipped = tokenizer_fingerprint(tokenizer) == tokenizer_fingerprint(load_tokenizer())
    return ChatFormat(end_of_turn=m.group(), added=pattern, slot_exact=shipped)


def plain_ids(tokenizer: PreTrainedTokenizerFast, text: str, at_start: bool = True) -> list[int]:
    """Ids of `text` through the tokenizer's normaliser, pre-tokeniser and model, skipping its added-token
    matching: equal to `tokenizer.encode(text, add_special_tokens=False)` when `text` holds no added-token
    string, and never an added token's id when it does (those strings are encoded as the bytes they are).

    at_start=False encodes `text` as a run that follows an added token inside a longer string (a chat's text
    after "<|im_start|>", "[/INST]", "</s>"): a SentencePiece-style Metaspace pre-tokeniser with
    prepend_scheme "first" (Llama / Mistral with legacy=False) prepends its "▁" only to the run at offset 0
    of the whole string, so such a run gets none. Normalisers (Llama 2's legacy Prepend), Metaspace
    "always" and byte-level add_prefix_space act on every run alike, which at_start does not change."""
    bt = tokenizer.backend_tokenizer
    if bt.normalizer is not None:
        text = bt.normalizer.normalize_str(text)
    pre = bt.pre_tokenizer if at_start else _pre_tokenizer_inside(tokenizer)
    pieces = pre.pre_tokenize_str(text) if pre is not None else [(text, None)]
    return [t.id for piece, _ in pieces for t in bt.model.tokenize(piece)]


@functools.lru_cache(maxsize=16)
def _pre_tokenizer_inside(tokenizer: PreTrainedTokenizerFast):
    """The tokenizer's pre-tokeniser as it acts on a run that does not start the string: every Metaspace
    with prepend_scheme "first" set to "never" (the same object when it has none)."""
    from tokenizers import Tokenizer

    state = json.loads(tokenizer.backend_tokenizer.to_str())
    changed = False

    def inside(node: object) -> None:
        nonlocal changed
        if isinstance(node, dict):
            if node.get("type") == "Metaspace" and node.get("prepend_scheme") == "first":
                node["prepend_scheme"], changed = "never", True
            for v in node.values():
                inside(v)
        elif isinstance(node, list):
            for v in node:
                inside(v)

    inside(state.get("pre_tokenizer"))
    if not changed:
        return tokenizer.backend_tokenizer.pre_tokenizer
    return Tokenizer.from_str(json.dumps(state)).pre_tokenizer


def encode_turn(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    """Ids of an assistant turn's `text` as the template's own tokenization of a conversation holds them
    between the generation prompt and the end of turn: what sampled ids must be for the rollout's identity
    (prompt + turn + end of turn + `encode_continuation`) to equal the whole conversation's ids. Differs from
    `tokenizer.encode(text)` wherever the tokenizer treats the start of a string specially (a Metaspace
    "first" tokenizer prepends "▁" there, not after "[/INST]"; a prefix-space byte-level one adds a space
    that the run "assistant\\n" + text does not get; Llama 3's template trims the text). Raises a ValueError
    when the template's tokenization is not prefix-stable at that point (the prompt's ids are not a prefix
    of the conversation's: e.g. a text starting with a newline that merges with the prompt's last one)."""
    user = [{"role": "user", "content": "."}]
    prompt = encode_chat(tokenizer, user, add_generation_prompt=True)
    whole = encode_chat(tokenizer, [*user, {"role": "assistant", "content": text}])
    eot = end_of_turn_id(tokenizer)
    if whole[:len(prompt)] != prompt or eot not in whole[len(prompt):]:
        raise ValueError(f"the chat template's tokenization of an assistant turn {text[:40]!r} does not "
                         "extend its generation prompt's ids (not prefix-stable there); sampled ids for it "
                         "cannot equal a re-tokenization of the conversation")
    rest = whole[len(prompt):]
    return rest[:rest.index(eot)]


def encode_text(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    """Ids of `text` as plain text: an added-token string inside it ("<|im_end|>", "</tool_response>") is
    encoded as "<" plus the rest in Odyssey's tokenizer (`plain_ids` in others), so it never becomes a special
    or markup id. decode() gives `text` back."""
    fmt = chat_format(tokenizer)
    if not fmt.slot_exact:
        return plain_ids(tokenizer, text)
    ids: list[int] = []
    pos = 0
    for m in fmt.added.finditer(text):
        ids += tokenizer.encode(text[pos:m.start()], add_special_tokens=False)
        ids += tokenizer.encode(m.group()[:1], add_special_tokens=False)
        ids += tokenizer.encode(m.group()[1:], add_special_tokens=False)
        pos = m.end()
    return ids + tokenizer.encode(text[pos:], add_special_tokens=False)


def _encode_slotted(
    tokenizer: PreTrainedTokenizerFast, text: str, texts: list[str | PreparedImage], slot_re: re.Pattern,
    at_start: bool = True,
) -> ChatEncoding:
    """Encode rendered text: template pieces with their special tokens, text slots as plain text, image slots
    as their image token block. at_start: `text` starts the encoded string (False for a continuation, which
    follows an end-of-turn token; `plain_ids`)."""
    slots = list(slot_re.finditer(text))
    if [int(m.group(1)) for m in slots] != list(range(len(texts))):
        raise AssertionError("the chat template dropped or reordered message content")
    fmt = chat_format(tokenizer)
    if not fmt.slot_exact:
        return _encode_runs(tokenizer, fmt, text, texts, slot_re, at_start)
    out = ChatEncoding([])
    ids = out.ids
    pos = 0
    for m in slots:
        ids += tokenizer.encode(text[pos:m.start()], add_special_tokens=False)
        content = texts[int(m.group(1))]
        if not isinstance(content, str):  # a PreparedImage (checked by _check_messages)
            out.images.append((len(ids), content))
            ids += image_token_ids(*content.grid)
        else:
            ids += encode_text(tokenizer, content)
        pos = m.end()
    ids += tokenizer.encode(text[pos:], add_special_tokens=False)
    return out


def _encode_runs(tokenizer: PreTrainedTokenizerFast, fmt: ChatFormat, text: str,
                 texts: list[str | PreparedImage], slot_re: re.Pattern,
                 at_start: bool = True) -> ChatEncoding:
    """`_encode_slotted` for a tokenizer that is not `slot_exact`: the template's added tokens by their ids,
    and each run of text between them (template text and content together) by `plain_ids`; only the run
    before the first added token starts the string (when `at_start`), as in the tokenizer's own encoding."""
    ids: list[int] = []
    run: list[str] = []
    first = [at_start]

    def flush() -> None:
        if run:
            ids.extend(plain_ids(tokenizer, "".join(run), at_start=first[0]))
            run.clear()
        first[0] = False

    pos = 0
    for m in [*slot_re.finditer(text), None]:
        piece = text[pos:m.start()] if m is not None else text[pos:]
        at = 0
        for a in fmt.added.finditer(piece):  # added tokens of the template itself
            run.append(piece[at:a.start()])
            flush()
            ids.append(tokenizer.convert_tokens_to_ids(a.group()))
            at = a.end()
        run.append(piece[at:])
        if m is None:
            break
        content = texts[int(m.group(1))]
        if not isinstance(content, str):
            raise ValueError("a message holds an image, and this tokenizer has no image tokens: only "
                             "Odyssey's model and tokenizer read images (docs/vision.md)")
        run.append(content)
        pos = m.end()
    flush()
    return ChatEncoding(ids)


def _as_rendered(marked: str, texts: list[str | PreparedImage], slot_re: re.Pattern,
                 render: Callable[[], str | None]) -> list[str | PreparedImage]:
    """The contents of `texts` as the template writes them: a template that trims content (Llama 3's
    `content | trim`) trims the slot marker, not the content, so each slot's text is read back from the real
    rendering (`render()`), matched against the marked one. Only trimming is accepted; a template that
    changes content otherwise is refused by name (its ids could not be the template's own)."""
    if not all(isinstance(t, str) for t in texts):
        return texts  # images: only Odyssey's tokenizer reads them (refused by _encode_runs)
    if slot_re.sub(lambda m: texts[int(m.group(1))], marked) == (real := render()):
        return texts
    pieces = slot_re.split(marked)  # literal, slot index, literal, ..., literal
    pattern = "".join(re.escape(x) if j % 2 == 0 else "(.*?)" for j, x in enumerate(pieces))
    m = re.fullmatch(pattern, real or "", re.DOTALL)
    out = list(texts)
    for got, idx in zip(m.groups() if m else (), pieces[1::2]):
        content = texts[int(idx)]
        if got not in (content, content.strip(), content.lstrip(), content.rstrip()):
            m = None
            break
        out[int(idx)] = got
    if m is None:
        raise ValueError("the chat template changes message content beyond trimming whitespace, so Odyssey "
                         "cannot encode its content as text (content must never become an added token); "
                         "use a template that renders each message's content as it is (or trimmed)")
    return out


def encode_chat(
    tokenizer: PreTrainedTokenizerFast,
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None = None,
    add_generation_prompt: bool = False,
) -> list[int]:
    """Token ids of `render_chat(...)` (the template already holds BOS; nothing else is added), with the
    content of non-assistant messages encoded as text (special-token strings in it become plain bytes) and
    each image part expanded to its image token block."""
    return encode_chat_images(tokenizer, messages, tools, add_generation_prompt).ids


def encode_chat_images(
    tokenizer: PreTrainedTokenizerFast,
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None = None,
    add_generation_prompt: bool = False,
) -> ChatEncoding:
    """`encode_chat`, also returning where each image block starts (`ChatEncoding`)."""
    _check_messages(messages)
    slotted, texts, slot_re = _slotted(messages)
    text = render_chat(tokenizer, slotted, tools, add_generation_prompt)
    if not chat_format(tokenizer).slot_exact:
        texts = _as_rendered(text, texts, slot_re,
                             lambda: render_chat(tokenizer, messages, tools, add_generation_prompt))
    return _encode_slotted(tokenizer, text, texts, slot_re)


def encode_continuation(
    tokenizer: PreTrainedTokenizerFast,
    new_messages: Sequence[dict[str, Any]],
    add_generation_prompt: bool = True,
) -> list[int]:
    """Ids the full template produces for `new_messages` right after an assistant turn's END_OF_TURN token.

    Starts with the newline that follows END_OF_TURN, then one rendered turn per message, then (optionally)
    the generation prompt "<|im_start|>assistant\\n". Exact because the preceding text ends in a special
    token, which the tokenizer always cuts out before pre-tokenization.
    """
    return encode_continuation_images(tokenizer, new_messages, add_generation_prompt).ids


def encode_continuation_images(
    tokenizer: PreTrainedTokenizerFast,
    new_messages: Sequence[dict[str, Any]],
    add_generation_prompt: bool = True,
) -> ChatEncoding:
    """`encode_continuation`, also returning where each image block starts (relative to the continuation)."""
    _check_messages(new_messages)
    slotted, texts, slot_re = _slotted(new_messages)
    # what the template renders after an assistant turn's end-of-turn token is the continuation
    eot = chat_format(tokenizer).end_of_turn
    after = _after_assistant_turn(tokenizer, slotted, add_generation_prompt)
    if after is None or not after.startswith(eot):
        raise AssertionError(f"the chat template does not close an assistant turn with {eot} when messages "
                             "follow it; encode_continuation cannot be exact")
    if not chat_format(tokenizer).slot_exact:
        real = list(new_messages)
        texts = _as_rendered(after, texts, slot_re,
                             lambda: _after_assistant_turn(tokenizer, real, add_generation_prompt))
    return _encode_slotted(tokenizer, after[len(eot):], texts, slot_re, at_start=False)


def image_token_ids_of(tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """The tokenizer's ids of <|image_start|>, <|image_pad|>, <|image_row_break|>, <|image_end|>: must be
    model.vision.IMAGE_TOKEN_IDS (checked by the build and tests/test_vision_tokenizer.py)."""
    return [tokenizer.convert_tokens_to_ids(t) for t in IMAGE_TOKENS]


def end_of_turn_id(tokenizer: PreTrainedTokenizerFast) -> int:
    """Id of the token that closes an assistant turn (`ChatFormat.end_of_turn`; END_OF_TURN in Odyssey's)."""
    return tokenizer.convert_tokens_to_ids(chat_format(tokenizer).end_of_turn)


def stop_token_ids(tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """Ids that end an assistant turn during sampling: the end of turn first, then EOS (when different)."""
    ids = [end_of_turn_id(tokenizer), tokenizer.eos_token_id]
    return [i for n, i in enumerate(ids) if i is not None and i not in ids[:n]]


# ---------------------------------------------------------------------------------------------------------
# CLI: python -m model.tokenizer build [--out DIR] [--check]
# ---------------------------------------------------------------------------------------------------------


def differing_files(a: Path, b: Path) -> list[str]:
    """Names of files present in only one of two directories or with different bytes."""
    names = sorted({p.name for p in a.iterdir()} | {p.name for p in b.iterdir()})
    both = [n for n in names if (a / n).is_file() and (b / n).is_file()]
    return [n for n in names if n not in both or not filecmp.cmp(a / n, b / n, shallow=False)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m model.tokenizer", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="train the BPE on model/assets/corpus and save it")
    b.add_argument("--out", type=Path, default=TOKENIZER_DIR, help="output dir (default: shipped)")
    b.add_argument("--corpus", type=Path, default=CORPUS_DIR, help="directory of *.txt corpus files")
    b.add_argument("--check", action="store_true", help="rebuild in a temp dir; exit 1 if --out differs")
    args = parser.parse_args(argv)

    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            build_tokenizer(tmp, args.corpus)
            diff = differing_files(Path(tmp), args.out)
        if diff:
            print(f"tokenizer files differ from a fresh build: {diff}; run `python -m model.tokenizer build`")
            return 1
        print(f"{args.out}: up to date")
        return 0
    out = build_tokenizer(args.out, args.corpus)
    tok = load_tokenizer.__wrapped__(str(out))
    print(f"wrote {out} (vocab {len(tok)}, {len(ALL_ADDED_TOKENS)} added tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
