#!/usr/bin/env bash
# The sharded learner's tests on nccl + CUDA, one GPU per rank: the same test code `make test` runs on gloo
# (tests/dist_backend.py reads ODYSSEY_TEST_BACKEND). Tests needing more ranks than there are GPUs are skipped
# with the reason (1 GPU: every multi-rank test skips; 2 GPUs: the 2-rank ones run; 4: all).
#
#   bash bench/gpu_sharding.sh            # writes $OUT/gpu_sharding.json (else bench/results/gpu_sharding.json)
#
# Files: FSDP (tests/test_learner_fsdp.py), EP and fsdp+ep incl. resume and bucketed sync
# (tests/test_expert_parallel.py), shard export (tests/test_shard_export.py), Ray placement
# (tests/test_learner_placement.py), odyssey train with fsdp+ep (tests/test_train_sharded.py).
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
  tests/test_learner_placement.py tests/test_train_sharded.py 2>&1 | tee "$DEST/gpu_sharding.log"
RC=${PIPESTATUS[0]}
"$VENV/bin/python" - "$XML" "$DEST/gpu_sharding.json" "$NGPU" "$RC" <<'PY'
import json, sys, xml.etree.ElementTree as ET
import torch
xml, out, ngpu, rc = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
cases = []
for tc in ET.parse(xml).getroot().iter("testcase"):
    status, reason = "passed", ""
    for tag in ("failure", "error", "skipped"):
        el = tc.find(tag)
        if el is not None:
            status, reason = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag], el.get("message", "")
    cases.append({"test": f"{tc.get('classname')}::{tc.get('name')}", "status": status,
                  "seconds": round(float(tc.get("time", 0)), 2), "reason": reason[:300]})
counts = {s: sum(c["status"] == s for c in cases) for s in ("passed", "failed", "error", "skipped")}
summary = {"backend": "nccl", "gpus": ngpu, "ran": True, "device": torch.cuda.get_device_name(0) if ngpu else None,
           "torch": torch.__version__, "pytest_rc": rc, "counts": counts, "cases": cases}
json.dump(summary, open(out, "w"), indent=1)
print(f"gpu_sharding: {counts} -> {out}")
PY
exit "$RC"
