"""`odyssey train`'s loop (Ray rollout workers, learner actor, weight sync, checkpoints) on an HF causal LM:
`model.hf_path` = a small random Llama made here that ships its own tokenizer (tests/foreign_tokenizers.py:
a ChatML template and vocabulary unlike Odyssey's), dataset-qa rows of examples/quickstart (no sandboxes).

Checks: two policy steps run; the first step's learner log-probs equal the rollout's (on-policy: ratio
1 and off-policy KL 0 within 1e-4, through Ray workers' TorchEngines, so workers and learner read the
checkpoint's tokenizer: the learner refuses trajectories of another); the weights move (the second
step's rollouts come from weights version 1); the checkpoint's policy is an HF Llama checkpoint that
transformers loads, with the same tokenizer beside it; a resume from it continues at step 2.
"""

from __future__ import annotations

import io
import json

import pytest
import torch

from model.tokenizer import policy_tokenizer, tokenizer_fingerprint
from tests.foreign_tokenizers import make_tokenizer
from tests.test_hf_policy import make_llama

pytestmark = [pytest.mark.ray, pytest.mark.slow]
PARITY_TOL = 1e-4


def _trainer(run_dir, hf_dir: str, steps: int):
    from rich.console import Console

    from rl.config import load_config
    from rl.train.loop import Trainer

    cfg = load_config("configs/quickstart.yaml", [
        f"logging.run_dir={run_dir}", f"model.hf_path={hf_dir}", f"learner.steps={steps}",
        "rollout.episodes=8", "rollout.max_new_tokens=12", "rollout.concurrent_episodes=4",
        "orchestrator.max_staleness=0", "orchestrator.checkpoint_every=1", "orchestrator.eval_every=0",
        "logging.tensorboard=false",
        # a reward with signal for a random policy (groups of equal rewards would train nothing)
        "rewards=[{name: 'tests.learner_fixtures:ascii_share'}]",
    ])
    return Trainer(cfg, console=Console(file=io.StringIO(), width=200))


@pytest.mark.timeout(900)
def test_odyssey_train_on_an_hf_llama_through_ray(ray_session, tmp_path):
    from transformers import AutoModelForCausalLM

    tok = make_tokenizer("chatml", tmp_path / "llama")
    hf_dir = make_llama(tmp_path / "llama", vocab_size=len(tok))
    run_dir = tmp_path / "run"
    _trainer(run_dir, hf_dir, steps=2).run()
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2], recs
    first = recs[0]
    assert abs(first["learner/offpolicy_ratio_mean"] - 1.0) <= PARITY_TOL, first
    assert abs(first["learner/offpolicy_kl"]) <= PARITY_TOL, first
    assert all(r["learner/loss"] == r["learner/loss"] and r["tokens"] > 0 for r in recs)
    assert all(r["learner/trained_trajectories"] > 0 and r["learner/optimizer_steps"] == 1 for r in recs)
    assert not any(k.startswith("moe/") for r in recs for k in r)
    ckpt = run_dir / "checkpoints" / "step-000002" / "learner" / "policy"
    assert json.loads((ckpt / "config.json").read_text())["model_type"] == "llama"
    assert tokenizer_fingerprint(policy_tokenizer(ckpt)) == tokenizer_fingerprint(tok)
    trained = AutoModelForCausalLM.from_pretrained(str(ckpt))
    start = AutoModelForCausalLM.from_pretrained(hf_dir)
    with torch.no_grad():
        moved = sum(float((a - b).abs().sum()) for a, b in zip(trained.parameters(), start.parameters()))
    assert moved > 0

    _trainer(run_dir, hf_dir, steps=3).run()  # resume from step 2 (orchestrator.resume defaults to true)
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3]
