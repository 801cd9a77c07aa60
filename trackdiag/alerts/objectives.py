"""What each component's loss is for, so loss rules judge only losses that should fall.

``diag.objective`` is ``minimize`` (a loss that training drives down: the loss rules apply),
``adversarial`` (a GAN's generator and discriminator: each loss rises and falls as the other
player improves) or ``rl`` (policy-gradient and actor-critic losses: summed over episodes that
grow as the agent improves, signed, non-stationary), for the whole run or per component
(``{G: adversarial, D: adversarial}``). Under ``adversarial`` and ``rl`` the rules about the loss
going the wrong way (spike, divergence, plateau, not learning, overfitting, chance level) are off
for that component; gradients, updates, weights and non-finite values are judged as usual.

``auto`` (the presets' default) resolves at the first steps: several components that each pass
their own loss to ``step()`` (``loss={"G": lg, "D": ld}``) are an adversarial set; anything else
is minimised. Host work only, once per new set of loss names.
"""
from __future__ import annotations

import logging
from typing import Any, Iterable, Mapping

log = logging.getLogger("trackdiag")


class Objectives:
    """The resolved objective per component (see module docstring)."""

    def __init__(self, setting: Any = "auto") -> None:
        self.given: dict[str, str] = dict(setting) if isinstance(setting, Mapping) else {"*": setting or "auto"}
        self.auto: dict[str, str] = {}
        self._seen: frozenset[str] = frozenset()

    def observe(self, loss_names: Iterable[str]) -> None:
        """The loss names of a step: several components with their own losses are an adversarial set."""
        names = frozenset(n for n in loss_names if n)
        if names == self._seen:
            return
        self._seen = names
        if len(names) >= 2:
            for n in names:
                self.auto[n] = "adversarial"
            if any(self.of(n) == "adversarial" for n in names):
                log.info("trackdiag: objective auto: %s each pass their own loss, judged as an adversarial set (a GAN: the "
                         "rules about a loss going the wrong way are off for them); pass objective='minimize' if each "
                         "loss should fall (co-teaching, mutual learning, an ensemble)", ", ".join(sorted(names)))

    def of(self, component: str) -> str:
        """``minimize`` | ``adversarial`` | ``rl`` for ``component`` (``""``: the single model)."""
        got = self.given.get(component, self.given.get("*", "auto"))
        if got == "auto":
            return self.auto.get(component, "minimize")
        return got

    def minimised(self, component: str) -> bool:
        return self.of(component) == "minimize"

    def summary(self) -> dict[str, str]:
        """The objective of every component seen so far that is not minimised."""
        names = {*self.given, *self.auto} - {"*"}
        return {n: self.of(n) for n in sorted(names) if self.of(n) != "minimize"} | (
            {"*": self.of("")} if self.of("") != "minimize" else {})
