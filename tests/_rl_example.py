"""A faithful copy of pytorch/examples ``reinforcement_learning/actor_critic.py`` integrated as a README user
would (``Diagnostics(model, optimizer)``, ``diag.step(loss)`` after ``optimizer.step()``), without
``objective="rl"``. One network with an action head (softmax) and a value head, CartPole-v1 one state at a
time, one Adam step (lr 3e-2) per episode on the loss summed over the episode (``-log_prob * advantage`` on
normalised returns + ``smooth_l1_loss`` of the value). Differences from the example, for time: a fixed number
of episodes (not "until solved"), and the episode ends at ``truncated`` too, capped at ``max_steps`` (the
example's loop reads only ``terminated`` and runs to 9,999 steps), and one intra-op thread.

Faults (planted at episode ``onset``): ``nan`` (the value head's output made NaN), ``lr1000`` (Adam's lr x1000).
"""
from __future__ import annotations

from collections import namedtuple
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn, optim
from torch.distributions import Categorical

import trackdiag
from _zoo_a import one_thread, quiet_probes

SavedAction = namedtuple("SavedAction", ["log_prob", "value"])
EPS = float(np.finfo(np.float32).eps)


class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.affine1 = nn.Linear(4, 128)
        self.action_head = nn.Linear(128, 2)
        self.value_head = nn.Linear(128, 1)
        self.saved_actions: list[SavedAction] = []
        self.rewards: list[float] = []
        self.poison = False  # the ``nan`` fault

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = F.relu(self.affine1(x))
        action_prob = F.softmax(self.action_head(x), dim=-1)
        state_values = self.value_head(x)
        if self.poison:
            state_values = state_values + (torch.log(torch.zeros(())) - torch.log(torch.zeros(())))
        return action_prob, state_values


def run(out: Path, *, level: str = "advanced", seed: int = 543, episodes: int = 300, max_steps: int = 200,
        fault: str | None = None, onset: int = 100, **overrides: Any) -> tuple[Any, list[float]]:
    """The example's training for ``episodes`` episodes; returns (the session, the episode rewards)."""
    import gymnasium as gym

    env = gym.make("CartPole-v1", max_episode_steps=max_steps)
    torch.manual_seed(seed)
    model = Policy()
    optimizer = optim.Adam(model.parameters(), lr=3e-2)
    diag = trackdiag.Diagnostics(model, optimizer, level=level, sinks=["local"], output_dir=str(out),
                                 probes=quiet_probes(), **overrides)
    rewards: list[float] = []

    def select_action(state: np.ndarray) -> int:
        probs, state_value = model(torch.from_numpy(state).float())
        m = Categorical(probs)
        action = m.sample()
        model.saved_actions.append(SavedAction(m.log_prob(action), state_value))
        return int(action.item())

    def finish_episode() -> None:
        R = 0.0
        policy_losses, value_losses, returns = [], [], []
        for r in model.rewards[::-1]:
            R = r + 0.99 * R
            returns.insert(0, R)
        ret = torch.tensor(returns)
        ret = (ret - ret.mean()) / (ret.std() + EPS)
        for (log_prob, value), R in zip(model.saved_actions, ret):
            advantage = R - value.item()
            policy_losses.append(-log_prob * advantage)
            value_losses.append(F.smooth_l1_loss(value, torch.tensor([R])))
        optimizer.zero_grad()
        loss = torch.stack(policy_losses).sum() + torch.stack(value_losses).sum()
        loss.backward()
        optimizer.step()
        del model.rewards[:], model.saved_actions[:]
        diag.step(loss)

    with one_thread(), diag:
        for i_episode in range(episodes):
            if fault == "lr1000" and i_episode == onset:
                for g in optimizer.param_groups:
                    g["lr"] *= 1000.0
            model.poison = fault == "nan" and i_episode >= onset
            state, _ = env.reset(seed=seed) if i_episode == 0 else env.reset()
            ep_reward = 0.0
            try:
                for _ in range(1, 10000):
                    action = select_action(state)
                    state, reward, terminated, truncated, _ = env.step(action)
                    model.rewards.append(float(reward))
                    ep_reward += float(reward)
                    if terminated or truncated:
                        break
                finish_episode()
            except ValueError:  # Categorical(probs=nan) after NaN weights: the script dies as the example would
                break
            rewards.append(ep_reward)
    env.close()
    return diag, rewards
