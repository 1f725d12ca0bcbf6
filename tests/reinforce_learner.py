"""`ReinforceLearner`: a minimal learner with rl.learner.Learner's API (step / state_dict / save / load), for
tests of the training loop's plumbing. Group-mean baseline REINFORCE on the generated tokens, AdamW.
The loop's real tests use rl.learner.Learner; this one only isolates loop logic from learner changes."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import numpy as np
import torch


class ReinforceLearner:
    def __init__(self, cfg):
        from rl.rollout.worker import WorkerSettings, build_policy

        torch.manual_seed(cfg.learner.seed)
        settings = dataclasses.replace(WorkerSettings.from_config(cfg), dtype="float32")
        self.policy = build_policy(settings).float().train()
        self.opt = torch.optim.AdamW(self.policy.parameters(), lr=cfg.learner.lr, weight_decay=0.0)
        self.steps = 0

    def step(self, trajectories) -> dict[str, float]:
        from rewards.compose import is_trainable

        groups: dict[str, list] = {}
        for t in trajectories:
            if is_trainable(t):
                groups.setdefault(t.metadata["group_id"], []).append(t)
        self.opt.zero_grad()
        loss_sum, n_tok = torch.zeros(()), 0
        for members in groups.values():
            r = np.array([t.rewards["total"] for t in members])
            for t, a in zip(members, r - r.mean()):
                ids = torch.from_numpy(t.tokens.astype(np.int64))
                lp = self.policy.token_logprobs(ids[:-1], ids[1:])
                m = torch.from_numpy(t.loss_mask[1:].astype(bool))
                loss_sum = loss_sum - float(a) * lp[m].sum()
                n_tok += int(m.sum())
        loss = loss_sum / max(1, n_tok)
        if n_tok:
            loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), 1.0)
        self.opt.step()
        self.steps += 1
        return {"loss": float(loss), "grad_norm": float(gn), "tokens": float(n_tok)}

    def state_dict(self):
        return {k: v.detach().clone() for k, v in self.policy.state_dict().items()}

    def save(self, path):
        path = Path(path)
        self.policy.save_pretrained(path / "policy")
        state = {"opt": self.opt.state_dict(), "steps": self.steps, "rng": torch.get_rng_state(),
                 "np": np.random.get_state(), "py": random.getstate()}
        torch.save(state, path / "state.pt")

    def load(self, path):
        from model.modeling import OdysseyForCausalLM

        path = Path(path)
        saved = OdysseyForCausalLM.from_pretrained(str(path / "policy"), dtype=torch.float32)
        self.policy.load_state_dict(saved.state_dict())
        state = torch.load(path / "state.pt", weights_only=False)
        self.opt.load_state_dict(state["opt"])
        self.steps = state["steps"]
        torch.set_rng_state(state["rng"])
        np.random.set_state(state["np"])
        random.setstate(state["py"])
