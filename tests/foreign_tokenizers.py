"""Tokenizers that are not Odyssey's, built here (nothing downloaded), as a pretrained checkpoint brings them.

Two families, each a byte-level BPE trained on model/assets/corpus with its own vocabulary (other ids than
Odyssey's for every text and every special token) and its own chat template, written here in the style of
the public templates of that family:

  chatml   Qwen2.5 / Qwen3 style: <|im_start|>role\\n...<|im_end|>\\n, a default system prompt, tools in
           the system turn, tool results grouped in a user turn as <tool_response>\\n...\\n</tool_response>,
           <tool_call> / </tool_call> added tokens. End of turn <|im_end|>, eos <|endoftext|>.
  llama3   Llama 3 style: <|begin_of_text|> in the template, <|start_header_id|>role<|end_header_id|>\\n\\n,
           content trimmed, tool results under the ipython role, tools as JSON in the first user turn. End
           of turn <|eot_id|>, eos <|end_of_text|>.

and, with the Mistral-style template below ([INST] ... [/INST], the assistant's content right after [/INST]
and closed by </s>, [TOOL_RESULTS]\\n ... [/TOOL_RESULTS], [AVAILABLE_TOOLS], a system prompt), the
SentencePiece-style pipelines of Llama / Mistral checkpoints (a BPE with byte fallback over "▁"-words):

  mistral          Metaspace pre-tokenizer, prepend_scheme "first" (Llama / Mistral converted with
                   legacy=False): "▁" only before the string's first run, never after an added token.
  metaspace_always Metaspace with prepend_scheme "always": "▁" before every run, after added tokens too.
  llama2_legacy    Llama 2's legacy pipeline: no pre-tokenizer, a Prepend("▁") + Replace(" ", "▁")
                   normalizer, which acts on every run between added tokens.
  chatml_prefix    the chatml family with a byte-level pre-tokenizer that adds a prefix space
                   (add_prefix_space=True, GPT-2 / RoBERTa style): a space before every run.
"""

from __future__ import annotations

import json
from pathlib import Path

from model.tokenizer import CORPUS_DIR, _corpus_texts

CHATML_TEMPLATE = r"""
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- else %}{{- 'You are a helpful assistant.\n\n' }}{%- endif %}
{{- '# Tools\n\nFunction signatures within <tools></tools>:\n<tools>' }}
{%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\n</tools>\n\nReturn each call as <tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- else %}
{{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or message.role == 'assistant' %}
{{- '<|im_start|>' + message.role + '\n' + (message.content or '') + '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
""".strip()  # noqa: E501

LLAMA3_TEMPLATE = r"""
{{- bos_token }}
{%- for message in messages %}
{%- set role = 'ipython' if message.role == 'tool' else message.role %}
{{- '<|start_header_id|>' + role + '<|end_header_id|>\n\n' }}
{%- if tools and loop.first and message.role == 'user' %}
{{- 'Respond with a JSON function call. Functions:\n' }}{%- for tool in tools %}{{- tool | tojson + '\n' }}{%- endfor %}
{%- endif %}
{{- (message.content or '') | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}
""".strip()  # noqa: E501

MISTRAL_TEMPLATE = r"""
{{- bos_token }}
{%- if tools %}{{- '[AVAILABLE_TOOLS]' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}{{- '[SYSTEM_PROMPT]' + message.content + '[/SYSTEM_PROMPT]' }}
{%- elif message.role == 'user' %}{{- '[INST] ' + message.content + '[/INST]' }}
{%- elif message.role == 'assistant' %}{{- (message.content or '') + eos_token }}
{%- elif message.role == 'tool' %}{{- '[TOOL_RESULTS]\n' + message.content + '[/TOOL_RESULTS]' }}
{%- else %}{{- raise_exception('unknown role ' + message.role) }}
{%- endif %}
{%- endfor %}
""".strip()  # noqa: E501

_SENTENCEPIECE = dict(
    special=["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
             "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"],
    markup=[], bos="<s>", eos="</s>", pad=None, template=MISTRAL_TEMPLATE, vocab=1400,
)

FAMILIES = {
    "chatml": dict(
        special=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        markup=["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"],
        bos=None, eos="<|endoftext|>", pad="<|endoftext|>", template=CHATML_TEMPLATE, vocab=1500,
    ),
    "llama3": dict(
        special=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                 "<|eot_id|>"],
        markup=[],
        bos="<|begin_of_text|>", eos="<|end_of_text|>", pad=None, template=LLAMA3_TEMPLATE, vocab=1200,
    ),
    "mistral": dict(_SENTENCEPIECE, style="metaspace_first"),
    "metaspace_always": dict(_SENTENCEPIECE, style="metaspace_always"),
    "llama2_legacy": dict(_SENTENCEPIECE, style="legacy"),
}
FAMILIES["chatml_prefix"] = dict(FAMILIES["chatml"], style="bytelevel_prefix")

#: every tokenizer style, for tests that run over all of them
STYLES = list(FAMILIES)


def _sentencepiece_style(spec: dict):
    """A SentencePiece-style BPE (byte fallback, "▁" for spaces) trained on the corpus, with spec's pipeline
    (Metaspace first / always, or Llama 2's legacy normalizer) and its special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    if spec["style"] == "legacy":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    else:
        scheme = "first" if spec["style"] == "metaspace_first" else "always"
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=spec["vocab"], min_frequency=2, show_progress=False,
                                  special_tokens=spec["special"][:3] + byte_tokens)
    tok.train_from_iterator(_corpus_texts(CORPUS_DIR), trainer)
    state = json.loads(tok.to_str())  # the byte tokens stay in the vocabulary, not as added tokens
    state["added_tokens"] = [t for t in state["added_tokens"] if t["content"] not in byte_tokens]
    tok = Tokenizer.from_str(json.dumps(state))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec["special"]])
    return tok


def make_tokenizer(family: str, out_dir: str | Path):
    """Train `family`'s tokenizer and save it (tokenizer.json, tokenizer_config.json with the chat template)
    to `out_dir`; returns the PreTrainedTokenizerFast. Its added tokens come after the merges, so their ids
    (and every text id, from the different vocabulary size and pre-tokenizer) differ from Odyssey's."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    spec = FAMILIES[family]
    if spec.get("style", "").startswith(("metaspace", "legacy")):
        hf = PreTrainedTokenizerFast(
            tokenizer_object=_sentencepiece_style(spec), bos_token=spec["bos"], eos_token=spec["eos"],
            unk_token="<unk>", chat_template=spec["template"], clean_up_tokenization_spaces=False)
        hf.save_pretrained(str(out_dir))
        return hf
    tok = Tokenizer(models.BPE())
    split = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"  # noqa: E501
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    if spec.get("style") == "bytelevel_prefix":  # GPT-2 / RoBERTa: the byte-level regex, a space before a run
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=spec["vocab"], min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus_texts(CORPUS_DIR), trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec["special"]])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec["markup"]])
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=spec["bos"], eos_token=spec["eos"], pad_token=spec["pad"],
        chat_template=spec["template"], clean_up_tokenization_spaces=False,
    )
    hf.save_pretrained(str(out_dir))
    return hf
