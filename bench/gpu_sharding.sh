#!/usr/bin/env bash
# The sharded learner's tests on nccl + CUDA, one GPU per rank: the same test code `make test` runs on gloo
# (tests/dist_backend.py reads ODYSSEY_TEST_BACKEND). Tests needing more ranks than there are GPUs are skipped
# with the reason (1 GPU: every multi-rank test skips; 2 GPUs: the 2-rank ones run; 4: all).
#
#   bash bench/gpu_sharding.sh            # writes $OUT/gpu_sharding.json (else bench/results/gpu_sharding.json)
#
# Files: FSDP (tests/test_learner_fsdp.py), EP and fsdp+ep incl. resume and bucketed sync
# (tests/test_expert_parallel.py), shard export (tests/test_shard_export.py), Ray placement
# (tests/test_learner_placement.py), odyssey train with fsdp+ep (tests/test_train_sharded.py), sequence
# chunking and context parallelism under sharding (tests/test_fsdp_chunks.py,
# tests/test_sharded_context_parallel.py).
# Environment: the repo's .venv (VENV=... to use another); no network needed.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
DEST=${OUT:-bench/results}
mkdir -p "$DEST"
export ODYSSEY_TEST_BACKEND=nccl RAY_AUTH_MODE=disabled OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
export VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0
NGPU=$("$VENV/bin/python" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
echo "gpu_sharding: ODYSSEY_TEST_BACKEND=nccl, $NGPU CUDA device(s) visible"
if [ "$NGPU" -lt 1 ]; then
  echo "gpu_sharding: no CUDA device; nothing to run (the gloo tests run in make test)" >&2
  echo '{"backend": "nccl", "gpus": 0, "ran": false, "reason": "no CUDA device"}' > "$DEST/gpu_sharding.json"
  exit 2
fi
XML="$DEST/gpu_sharding.junit.xml"
"$VENV/bin/pytest" -q -rs -p no:cacheprovider --junitxml="$XML" \
  tests/test_learner_fsdp.py tests/test_expert_parallel.py tests/test_shard_export.py \
  tests/test_learner_placement.py tests/test_train_sharded.py tests/test_fsdp_chunks.py \
  tests/test_sharded_context_parallel.py tests/test_context_parallel_checkpointing.py 2>&1 | tee "$DEST/gpu_sharding.log"
RC=${PIPESTATUS[0]}
"$VENV/bin/python" bench/junit_summary.py "$XML" "$DEST/gpu_sharding.json" "$NGPU" "$RC" backend=nccl
exit "$RC"
