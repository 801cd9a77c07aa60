"""Actor-critic on gymnasium's CartPole in the style of PyTorch's
``examples/reinforcement_learning/actor_critic.py``: one network with an action head (softmax) and a
value head, actions sampled from ``Categorical(probs)`` one state at a time, and **one optimizer step
per episode** on the loss summed over the episode's steps (policy terms ``-log_prob * advantage`` on
normalised returns + ``smooth_l1_loss`` value terms). Adam at lr 3e-2 as in the example; episodes are
capped at 40 steps (``max_episode_steps``) to keep the run short (a single-state forward, a
``Categorical`` and its share of the backward cost ~0.4 ms per environment step here).

Mechanisms: an objective that is not a loss to minimise (the summed loss grows as episodes get
longer: that is the agent learning), one step per episode of varying length, no batch.
"""
from __future__ import annotations

from collections import namedtuple
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

NAME = "actor_critic"
DESCRIPTION = "pytorch/examples reinforcement_learning/actor_critic.py: CartPole, episode-summed loss, Adam 3e-2"
FAULTS = {
    "nan": "log(0) in the critic's `value_head` from onset (the next episode's probabilities are NaN: "
           "Categorical raises one episode later)",
    "crash_nan": "log(0) in the actor's `action_head` from onset: Categorical(probs=nan) raises before diag.step",
    "lr1000": "Adam lr x1000 from onset",
    "lr_start": "Adam lr x1000 from step 0",
    "no_zero": "optimizer.zero_grad() dropped from onset",
    "wiped_grads": "clip_grad_norm_(max_norm=0) between backward and step from onset",
    "reversed_ema": "from onset a reversed EMA update pulls the policy/value net toward a copy taken at onset after each step",
}
SavedAction = namedtuple("SavedAction", ["log_prob", "value"])
EPS = float(np.finfo(np.float32).eps)
MAX_EPISODE_STEPS = 40


class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.affine1 = nn.Linear(4, 128)
        self.action_head = nn.Linear(128, 2)
        self.value_head = nn.Linear(128, 1)
        self.saved_actions: list[SavedAction] = []
        self.rewards: list[float] = []

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = F.relu(self.affine1(x))
        action_prob = F.softmax(self.action_head(x), dim=-1)
        return action_prob, self.value_head(x)


def select_action(model: Policy, state: np.ndarray) -> int:
    probs, state_value = model(torch.from_numpy(state).float())
    m = Categorical(probs)
    action = m.sample()
    model.saved_actions.append(SavedAction(m.log_prob(action), state_value))
    return int(action.item())


def episode_loss(model: Policy, gamma: float = 0.99) -> torch.Tensor:
    R = 0.0
    returns: list[float] = []
    for r in model.rewards[::-1]:
        R = r + gamma * R
        returns.insert(0, R)
    ret = torch.tensor(returns)
    ret = (ret - ret.mean()) / (ret.std() + EPS)
    policy_losses, value_losses = [], []
    for (log_prob, value), R in zip(model.saved_actions, ret):
        advantage = R - value.item()
        policy_losses.append(-log_prob * advantage)
        value_losses.append(F.smooth_l1_loss(value, torch.tensor([R])))
    return torch.stack(policy_losses).sum() + torch.stack(value_losses).sum()


def run(out: Path, *, level: str = "advanced", seed: int = 0, steps: int = 300, fault: str | None = None,
        onset: int = 40, **diag_overrides: Any) -> StyleRun:
    import gymnasium as gym

    check_fault(fault, FAULTS)
    timer = Timer()
    torch.manual_seed(seed)
    env = gym.make("CartPole-v1", max_episode_steps=MAX_EPISODE_STEPS)
    model = Policy()
    model.value_head = NanGate(model.value_head)
    model.action_head = NanGate(model.action_head)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-2 * (1000 if fault == "lr_start" else 1))
    ep_rewards: list[float] = []
    pull = PullBack(fault, onset, model)
    diag = session(model, optimizer, out, level, **{"objective": "rl", **diag_overrides})  # README: RL losses are not minimised
    with crash_guard(fault) as crash, one_thread(), diag:
        state, _ = env.reset(seed=seed)
        for i_episode in range(steps):
            if fault == "lr1000" and i_episode == onset:
                bump_lr(optimizer, 1000.0)
            model.value_head.arm(active(fault, "nan", i_episode, onset))
            model.action_head.arm(active(fault, "crash_nan", i_episode, onset))
            if i_episode:
                state, _ = env.reset()
            ep_rewards.append(play(env, lambda s: select_action(model, s), model.rewards, state))
            # finish_episode()
            if not active(fault, "no_zero", i_episode, onset):
                optimizer.zero_grad()
            loss = episode_loss(model)
            loss.backward()
            if active(fault, "wiped_grads", i_episode, onset):
                wipe_grads(model.parameters())
            optimizer.step()
            pull(i_episode)
            del model.rewards[:], model.saved_actions[:]
            diag.step(loss)
    env.close()
    progress = Progress("episode reward", mean(ep_rewards[:20]), mean(ep_rewards[-20:]), higher_is_better=True,
                        min_gain=10.0)
    culprit = "action_head" if fault == "crash_nan" else "value_head"
    return StyleRun(diag, fault_onset(fault, onset), steps, culprit, fault, progress, crash["error"], timer.seconds)
