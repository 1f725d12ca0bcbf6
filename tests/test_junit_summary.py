"""bench/junit_summary.py: the GPU check scripts' JSON summary of a pytest JUnit report, on a real report of
a real pytest run (one passing, one failing, one skipped test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CASES = '''
import pytest

def test_ok():
    assert 1 + 1 == 2

def test_bad():
    assert 1 + 1 == 3, "arithmetic"

def test_gpu():
    pytest.skip("needs a CUDA GPU")
'''


def test_a_real_report_is_summarised(tmp_path):
    (tmp_path / "test_cases.py").write_text(CASES)
    xml, out = tmp_path / "r.xml", tmp_path / "r.json"
    rc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
                         str(tmp_path / "test_cases.py")], cwd=tmp_path, capture_output=True).returncode
    assert rc == 1
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "junit_summary.py"), str(xml), str(out), "0",
                           str(rc), "backend=nccl"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    s = json.loads(out.read_text())
    assert s["counts"] == {"passed": 1, "failed": 1, "error": 0, "skipped": 1}
    assert s["backend"] == "nccl" and s["gpus"] == 0 and s["device"] is None and s["pytest_rc"] == 1
    by = {c["test"].split("::")[-1]: c for c in s["cases"]}
    assert by["test_bad"]["status"] == "failed" and "arithmetic" in by["test_bad"]["reason"]
    assert by["test_gpu"]["status"] == "skipped" and "CUDA" in by["test_gpu"]["reason"]
