"""Remedies for a non-finite alert that follow what the NaN replay found (:mod:`trackdiag.forensics.replay`).

The generic ``nonfinite_loss`` hint lists every usual cause; once the replay has located the first
non-finite value, only the remedies for that cause are useful: bad data, an op inside a module, its
backward, the loss function, or weights the optimizer had already broken. Text only, no cost.
"""
from __future__ import annotations

from trackdiag.core.alert import Alert
from trackdiag.forensics.replay import Finding


#: when the optimizer steps the input itself (style transfer, feature visualisation): NaN in it is the step's doing
STEPPED_INPUT = ("The optimizer steps the input (not the model's parameters), so the NaN/Inf in it was written by an "
                 "optimizer step too large, not brought by the data: lower the learning rate, clamp the input after "
                 "each step, clip its gradient, or give LBFGS line_search_fn='strong_wolfe'.")


def replay_hint(found: Finding, alert: Alert, where: str, data: bool, stepped: bool = False) -> str:
    """The remedies that fit what the replay found (the rule's generic hint when it found nothing);
    ``stepped``: the optimizer steps an input, which is then no data a lower learning rate cannot help."""
    mod = where.split(" (")[0] or "this module"
    if stepped and (data or alert.kind == "nonfinite_input" or found.input_finite is False or found.phase == "params"):
        return STEPPED_INPUT
    if alert.kind == "nonfinite_input":
        return alert.hint
    if data or (found.phase == "params" and found.input_finite is False):
        return ("The NaN/Inf came in with the batch, not from the model: fix the data (see the nonfinite_input alert) "
                "-- check the preprocessing (division by a zero std, log of 0, corrupt or missing values), add "
                "torch.nan_to_num or drop the bad samples. A lower learning rate will not help.")
    if found.phase == "forward" and found.input_finite is False:
        return (f"The input of {mod} already held NaN/Inf although no module before it produced one: check the batch "
                "and the functional ops between modules in forward() (torch.log, division, sqrt, exp); guard them with "
                "an eps or a clamp (log(x + 1e-8)).")
    if found.phase == "forward":
        return (f"{mod} turned finite inputs into NaN/Inf: guard the log/div/sqrt/exp it computes with an eps or a clamp "
                "(log(x + 1e-8), x / (y + 1e-8)); if its weights or inputs grew huge, lower the learning rate and clip "
                "gradients; under fp16 autocast use bf16 or a GradScaler.")
    if found.phase == "observed" and found.input_finite is False:
        return (f"The input of {mod} already held NaN/Inf although no module the hooks saw before it produced one: the "
                "value was made in code hooks cannot see -- functional ops between modules in forward() (torch.log, "
                "division, sqrt, exp) or layers called as .forward(). Guard those ops with an eps or a clamp; call "
                "layers as layer(x), or hand trackdiag your loss (loss_fn=lambda batch: ...) so the replay watches them.")
    if found.phase == "observed":
        return (f"{mod} produced the step's first non-finite output (seen by the hooks in the real forward). Guard the "
                "log/div/sqrt/exp it computes with an eps or a clamp; check its inputs and weights for huge values (lower "
                "the learning rate, clip gradients); under fp16 autocast use bf16 or a GradScaler. If a replay of the "
                "step did not reproduce it, the fault may be transient (hardware, a race, a condition that passed).")
    if found.phase == "backward":
        return (f"The backward of {mod} produced NaN/Inf from finite values: typical of sqrt/pow/norm at 0, log of 0, "
                "division by ~0 or torch.where over a NaN branch; add an eps (sqrt(x + 1e-12)), clamp, or compute the "
                "masked branch on safe values.")
    if found.phase == "loss":
        return ("The loss function produced NaN/Inf from finite outputs: use F.cross_entropy / log_softmax on logits "
                "instead of log(softmax(x)), put an eps inside log and division, check the targets (range, NaN).")
    if found.phase == "params":
        return ("The optimizer had already written NaN/Inf into the weights: lower the learning rate or add warm-up, "
                "clip gradients (clip_grad_norm_), check the optimizer's eps; restore the last good checkpoint. "
                "diag.probes.nan_replay.mode=step finds the op before the update.")
    return alert.hint
