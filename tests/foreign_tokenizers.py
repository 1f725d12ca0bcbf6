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
"""

from __future__ import annotations

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
}


def make_tokenizer(family: str, out_dir: str | Path):
    """Train `family`'s tokenizer and save it (tokenizer.json, tokenizer_config.json with the chat template)
    to `out_dir`; returns the PreTrainedTokenizerFast. Its added tokens come after the merges, so their ids
    (and every text id, from the different vocabulary size and pre-tokenizer) differ from Odyssey's."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    spec = FAMILIES[family]
    tok = Tokenizer(models.BPE())
    split = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"  # noqa: E501
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
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
