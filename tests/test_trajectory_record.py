"""envs/trajectory.py: the typed step-info record, and the record module as a numpy-only leaf."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from envs.trajectory import StepInfo
from rl.trajectory import trajectories_to_batch, trajectory_from_batch
from tests.traj_factory import make_traj, step

REPO = Path(__file__).resolve().parents[1]


def test_step_info_from_the_env_dict_and_back():
    """An env's info dict (gymnasium form) becomes typed fields plus `extra`; to_dict gives it back."""
    d = step(subgoals=["a"], tool_errors=["bad"]) | {"turn": 2, "no_tool_call": False, "my_key": [1, 2]}
    info = StepInfo.from_dict(d)
    assert info.subgoals == ["a"] and info.tool_errors == ["bad"] and info.turn == 2
    assert info.extra == {"my_key": [1, 2]} and info.success is None
    assert info.to_dict() == d and info == d and d == info  # equal to the dict it came from
    # dict-style reads for code written against the dicts; "success" is absent until it is set
    assert info["tool_calls"][0]["name"] == "calc" and info.get("success") is None and "success" not in info
    info["success"] = 1
    assert info.success == 1.0 and isinstance(info.success, float) and info["success"] == 1.0
    info["note"] = "x"
    assert info.extra["note"] == "x" and list(info)[-2:] == ["my_key", "note"]
    del info["success"]
    assert "success" not in info and "success" not in info.to_dict()


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"tool_errors": "oops"}, r"tool_errors must be a list of str"),
        ({"tool_calls": ["calc"]}, r"tool_calls must be a list of \{name, arguments\} dicts"),
        ({"env_reward": float("nan")}, r"env_reward must be a finite number"),
        ({"turn": "3"}, r"turn must be an int"),
        ({"success": "yes"}, r"success must be a finite number"),
    ],
)
def test_step_info_rejects_malformed_fields_naming_them(bad, match):
    with pytest.raises(TypeError, match=match):
        StepInfo.from_dict(bad)
    info = StepInfo()
    with pytest.raises(TypeError, match=match):  # assignment through the dict view is checked too
        info[next(iter(bad))] = next(iter(bad.values()))


def test_step_infos_are_typed_and_stored_as_the_same_json_dicts():
    """Trajectory converts dict step infos to StepInfo; the Arrow column holds exactly the old dicts (so
    stores written before the record existed read back, and new stores read the same JSON)."""
    old = [step(subgoals=["a"]), {"infra_error": "SandboxCrashed: oom", "legacy": np.int64(3)}]
    t = make_traj([("prompt", 3), ("assistant", 2), ("observation", 2), ("assistant", 2)], step_infos=old)
    assert all(isinstance(s, StepInfo) for s in t.step_infos)
    assert t.step_infos[1].infra_error == "SandboxCrashed: oom" and t.step_infos[1].tool_calls == []
    batch = trajectories_to_batch([t])
    stored = json.loads(batch.column("step_infos")[0].as_py())
    assert stored[0] == old[0] | {"turn": None, "no_tool_call": False}
    assert stored[1]["legacy"] == 3 and "success" not in stored[1]
    back = trajectory_from_batch(batch)
    assert back.step_infos == t.step_infos and isinstance(back.step_infos[0], StepInfo)


def test_record_module_is_a_leaf():
    """Importing the record (and rewards/, which reads it) loads no Arrow, gymnasium, Docker, torch or rl/
    module: rewards/ has no arrow up to rl/, and envs/__init__ does not drag the env stack in."""
    code = (
        "import sys, envs.trajectory, rewards\n"
        "heavy = ('pyarrow', 'gymnasium', 'docker', 'torch', 'rl', 'sandbox', 'transformers')\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & set(heavy)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
