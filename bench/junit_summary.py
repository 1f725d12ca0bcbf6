"""A pytest JUnit XML report -> one JSON summary: per-test status, seconds and skip/failure reason, counts,
the CUDA device. Used by the GPU check scripts (bench/gpu_hybrid.sh, bench/gpu_sharding.sh).

    python bench/junit_summary.py REPORT.xml OUT.json NGPU PYTEST_RC [key=value ...]  # extra fields
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET

STATUS = {"failure": "failed", "error": "error", "skipped": "skipped"}


def summarise(xml: str, ngpu: int, rc: int, extra: dict[str, str]) -> dict:
    import torch

    cases = []
    for tc in ET.parse(xml).getroot().iter("testcase"):
        status, reason = "passed", ""
        for tag, name in STATUS.items():
            el = tc.find(tag)
            if el is not None:
                status, reason = name, el.get("message", "")
        cases.append({"test": f"{tc.get('classname')}::{tc.get('name')}", "status": status,
                      "seconds": round(float(tc.get("time", 0)), 2), "reason": reason[:300]})
    counts = {s: sum(c["status"] == s for c in cases) for s in ("passed", "failed", "error", "skipped")}
    return {**extra, "gpus": ngpu, "ran": True,
            "device": torch.cuda.get_device_name(0) if ngpu else None, "torch": torch.__version__,
            "pytest_rc": rc, "counts": counts, "cases": cases}


def main(argv: list[str]) -> None:
    if len(argv) < 4:
        sys.exit(__doc__)
    xml, out, ngpu, rc = argv[0], argv[1], int(argv[2]), int(argv[3])
    extra = dict(a.split("=", 1) for a in argv[4:])
    summary = summarise(xml, ngpu, rc, extra)
    with open(out, "w") as f:
        json.dump(summary, f, indent=1)
    print(f"{summary['counts']} -> {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
