# Odyssey: `make demo` and `make test` are all a fresh machine needs.
.PHONY: setup demo test test-fast lint bench clean-sandboxes
VENV := .venv
PY := $(VENV)/bin/python
export VLLM_CPU_KVCACHE_SPACE ?= 1
export VLLM_ENABLE_V1_MULTIPROCESSING ?= 0
export RAY_AUTH_MODE ?= disabled
export PYTHONUNBUFFERED := 1
# Heavy tests fail (not skip) when their component is missing: CI must not pass by skipping.
export ODYSSEY_REQUIRE_DOCKER ?= 1

setup:
	@bash scripts/setup.sh

## The main job, end to end on CPU: SFT warm-up of the tiny policy on oracle arith episodes (skipped when
## runs/tiny/warmup already holds it), then RL (RAFT: each group's best successes) with rollouts in real
## Docker sandboxes, evaluated on held-out tasks before the first and after the last step (re-running
## resumes, or just reprints a finished run).
demo: setup
	$(VENV)/bin/odyssey warmup configs/tiny.yaml --out $(CURDIR)/runs/tiny/warmup
	$(VENV)/bin/odyssey train configs/tiny.yaml model.init_from=$(CURDIR)/runs/tiny/warmup \
		learner.advantage=raft learner.steps=40 learner.lr=1e-4 learner.warmup_steps=3 learner.ppo_epochs=4 \
		logging.run_dir=$(CURDIR)/runs/tiny/rl

## The whole suite, heavy tests (docker, ray, vllm, slow) included; per-test times in runs/pytest-junit.xml.
test: setup
	$(VENV)/bin/pytest -q --durations=15 --junitxml=runs/pytest-junit.xml

## Pure-Python/numerics only (no Docker, Ray, vLLM): the inner loop while developing.
test-fast: setup
	$(VENV)/bin/pytest -q -m "not docker and not ray and not vllm and not slow"

lint:
	$(VENV)/bin/ruff check .

bench: setup
	@for b in bench/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

## Remove every Odyssey sandbox container on this host (the reaper does this for dead owners).
clean-sandboxes:
	$(VENV)/bin/odyssey sandbox gc --all
