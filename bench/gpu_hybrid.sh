#!/usr/bin/env bash
# The HF hybrids' CUDA checks: fla-core's Triton kernels behind Odyssey's contracts, vs the torch forms.
#   tests/test_hf_gated_delta.py  fla `chunk_gated_delta_rule` (model/gated_delta_fla.py) vs the naive oracle
#                                 (fp64) and the torch chunkwise form: outputs, states, grads, fp32 and bf16;
#                                 qwen3_next / qwen3_5 packed log-probs on CUDA, fla vs torch forms
#   tests/test_hf_hybrid.py       kimi_linear / glm5_next packed log-probs on CUDA, fla `chunk_kda` vs torch
#   tests/test_kda_fla.py         fla `chunk_kda` (model/kda_fla.py) vs our KDA reference
# Only the tests whose names contain "cuda" run (the CPU tests of these files run in make test). The measured
# errors are printed (-s) into the log: tighten the FLA_TOL bounds from them.
#
#   bash bench/gpu_hybrid.sh            # writes $OUT/gpu_hybrid.json (else bench/results/gpu_hybrid.json)
#
# Environment: the repo's .venv with the gpu extra (fla-core) (VENV=... to use another); no network needed.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
DEST=${OUT:-bench/results}
mkdir -p "$DEST"
export RAY_AUTH_MODE=disabled OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
NGPU=$("$VENV/bin/python" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
echo "gpu_hybrid: $NGPU CUDA device(s) visible"
if [ "$NGPU" -lt 1 ]; then
  echo "gpu_hybrid: no CUDA device; nothing to run (fla's Triton kernels need one)" >&2
  echo '{"gpus": 0, "ran": false, "reason": "no CUDA device"}' > "$DEST/gpu_hybrid.json"
  exit 2
fi
XML="$DEST/gpu_hybrid.junit.xml"
"$VENV/bin/pytest" -q -s -rs -p no:cacheprovider --junitxml="$XML" -k cuda \
  tests/test_hf_gated_delta.py tests/test_hf_hybrid.py tests/test_kda_fla.py 2>&1 | tee "$DEST/gpu_hybrid.log"
RC=${PIPESTATUS[0]}
"$VENV/bin/python" bench/junit_summary.py "$XML" "$DEST/gpu_hybrid.json" "$NGPU" "$RC"
exit "$RC"
