"""REINFORCE on gymnasium's CartPole in the style of PyTorch's
``examples/reinforcement_learning/reinforce.py``: a policy with Dropout(0.6), ``Categorical(probs)``
sampling one state at a time, returns normalised to zero mean and unit variance, and one Adam step
(lr 1e-2) per episode on ``sum(-log_prob * return)``. Episodes are capped at 40 steps.

Mechanisms: a policy-gradient "loss" that is not a loss (normalised returns make it hover around
zero and go **negative**; its value says nothing about progress: the episode reward does), one
step per episode of varying length, Dropout in a policy.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import Categorical

from ._common import (NanGate, Progress, StyleRun, Timer, active, bump_lr, check_fault, crash_guard, fault_onset,
                      mean, one_thread, play, session, wipe_grads)
from ._common import PullBack

NAME = "reinforce"
DESCRIPTION = "pytorch/examples reinforcement_learning/reinforce.py: CartPole, sum(-log_prob*R), Adam 1e-2"
FAULTS = {
    "crash_nan": "log(0) in `affine2` from onset: Categorical(probs=nan) raises before diag.step",
    "lr1000": "Adam lr x1000 from onset",
    "lr_start": "Adam lr x1000 from step 0",
    "no_zero": "optimizer.zero_grad() dropped from onset",
    "eval_mode": "policy.eval() left on (Dropout off)",
    "wiped_grads": "clip_grad_norm_(max_norm=0) between backward and step from onset",
    "reversed_ema": "from onset a reversed EMA update pulls the policy toward a copy taken at onset after each step",
}
EPS = float(np.finfo(np.float32).eps)
MAX_EPISODE_STEPS = 40


class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.affine1 = nn.Linear(4, 128)
        self.dropout = nn.Dropout(p=0.6)
        self.affine2 = nn.Linear(128, 2)
        self.saved_log_probs: list[torch.Tensor] = []
        self.rewards: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.dropout(self.affine1(x)))
        return F.softmax(self.affine2(x), dim=1)


def select_action(policy: Policy, state: np.ndarray) -> int:
    probs = policy(torch.from_numpy(state).float().unsqueeze(0))
    m = Categorical(probs)
    action = m.sample()
    policy.saved_log_probs.append(m.log_prob(action))
    return int(action.item())


def policy_loss(policy: Policy, gamma: float = 0.99) -> torch.Tensor:
    R = 0.0
    returns: list[float] = []
    for r in policy.rewards[::-1]:
        R = r + gamma * R
        returns.insert(0, R)
    ret = torch.tensor(returns)
    ret = (ret - ret.mean()) / (ret.std() + EPS)
    return torch.cat([-log_prob * R for log_prob, R in zip(policy.saved_log_probs, ret)]).sum()


def run(out: Path, *, level: str = "advanced", seed: int = 0, steps: int = 300, fault: str | None = None,
        onset: int = 40, **diag_overrides: Any) -> StyleRun:
    import gymnasium as gym

    check_fault(fault, FAULTS)
    timer = Timer()
    torch.manual_seed(seed)
    env = gym.make("CartPole-v1", max_episode_steps=MAX_EPISODE_STEPS)
    policy = Policy()
    policy.affine2 = NanGate(policy.affine2)
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-2 * (1000 if fault == "lr_start" else 1))
    ep_rewards: list[float] = []
    pull = PullBack(fault, onset, policy)
    diag = session(policy, optimizer, out, level, **{"objective": "rl", **diag_overrides})  # README: RL losses are not minimised
    with crash_guard(fault) as crash, one_thread(), diag:
        if fault == "eval_mode":
            policy.eval()
        state, _ = env.reset(seed=seed)
        for i_episode in range(steps):
            if fault == "lr1000" and i_episode == onset:
                bump_lr(optimizer, 1000.0)
            policy.affine2.arm(active(fault, "crash_nan", i_episode, onset))
            if i_episode:
                state, _ = env.reset()
            ep_rewards.append(play(env, lambda s: select_action(policy, s), policy.rewards, state))
            # finish_episode()
            if not active(fault, "no_zero", i_episode, onset):
                optimizer.zero_grad()
            loss = policy_loss(policy)
            loss.backward()
            if active(fault, "wiped_grads", i_episode, onset):
                wipe_grads(policy.parameters())
            optimizer.step()
            pull(i_episode)
            del policy.rewards[:], policy.saved_log_probs[:]
            diag.step(loss)
    env.close()
    # learned: the last 100 episodes close half the gap between the first 20 and the cap (REINFORCE at the cap
    # still dips for a few episodes now and then: a last-20 mean fell to 28.6 after 100 episodes at 38-40)
    start = mean(ep_rewards[:20])
    progress = Progress("episode reward", start, mean(ep_rewards[-100:]), higher_is_better=True,
                        min_gain=(MAX_EPISODE_STEPS - start) / 2)
    return StyleRun(diag, fault_onset(fault, onset), steps, "affine2", fault, progress, crash["error"], timer.seconds)
