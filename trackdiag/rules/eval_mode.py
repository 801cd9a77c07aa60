"""``eval_train_mode``: an evaluation run with the model in training mode (the ``eval_mode`` probe's keys)."""
from __future__ import annotations

from typing import Sequence

from trackdiag.capture.context import component_of
from trackdiag.core.alert import Alert
from trackdiag.core.record import Record
from trackdiag.rules.base import OncePer


class EvalTrainMode(OncePer):
    """Fires at a ``log_eval`` whose evaluation called a model without autograd while it was in training mode and held
    dropout or BatchNorm layers in training mode (``diag/[<c>/]model/eval_train_calls`` > 0 and the table
    ``eval_train_modules``): ``model.eval()`` was forgotten before the validation pass. Dropout makes the evaluation
    noisy and pessimistic; BatchNorm normalises with each evaluation batch's statistics and folds them into its running
    ones, so the model used afterwards has seen the validation data. ``step``: the evaluation's; ``persistent`` (a
    warning). Once per component."""

    kind = "eval_train_mode"
    hint = ("Call model.eval() before the evaluation pass and model.train() after it (dropout off, BatchNorm on its "
            "running statistics); torch.no_grad() alone does not change the mode. Dropout wanted at evaluation (Monte "
            "Carlo dropout): diag.rules.eval_train_mode.enabled=false.")

    def check_eval(self, record: Record, history: Sequence[Record]) -> list[Alert]:
        out = []
        for key, calls in record.scalars.items():
            if not key.endswith("model/eval_train_calls") or calls <= 0:
                continue
            modules = record.tables.get(key.replace("eval_train_calls", "eval_train_modules"))
            comp = component_of(key, "model/eval_train_calls")
            if not modules or not self.first(comp):
                continue
            drop = {k: v for k, v in modules.items() if v == 1.0}
            norm = {k: v for k, v in modules.items() if v == 2.0}
            what = "; ".join(filter(None, [
                f"dropout was on in {_named(drop)}" if drop else "",
                f"BatchNorm normalised with the evaluation batches' statistics and folded them into its running ones "
                f"in {_named(norm)}" if norm else ""]))
            whose = f"component {comp!r}" if comp else "the model"
            msg = (f"the evaluation logged at step {record.step} called {whose} {int(calls)} time(s) without autograd "
                   f"while it was in training mode: {what}. model.eval() was not called before the evaluation: its "
                   f"results are noisier and worse than the model's, and the model used afterwards has seen the "
                   f"evaluation data.")
            out.append(self.make(record.step, msg, calls, 0.0, key, ["persistent"]))
        return out


def _named(modules: dict[str, float]) -> str:
    names = sorted(modules)
    return ", ".join(names[:4]) + (f" (+{len(names) - 4} more)" if len(names) > 4 else "")


class EvalDropout(OncePer):
    """Fires at a ``log_eval`` whose evaluation ran a functional dropout with ``training=True`` inside a module in
    eval mode (the ``eval_mode`` probe's table ``[<c>/]model/eval_dropout``, ``{module: p}``): ``F.dropout(x, p)``
    without ``training=self.training`` ignores ``model.eval()``, so every evaluation and every prediction after
    training drops units at random. ``step``: the evaluation's; ``persistent`` (a warning). Once per component."""

    kind = "eval_dropout"
    hint = ("Pass the module's mode: F.dropout(x, p, training=self.training) (its default is training=True), or use "
            "an nn.Dropout module, which model.eval() switches off. Dropout wanted at evaluation (Monte Carlo "
            "dropout): diag.rules.eval_dropout.enabled=false.")

    def check_eval(self, record: Record, history: Sequence[Record]) -> list[Alert]:
        out = []
        for key, found in record.tables.items():
            if not key.endswith("model/eval_dropout") or not found:
                continue
            comp = component_of(key, "model/eval_dropout")
            if not self.first(comp):
                continue
            whose = f"component {comp!r}" if comp else "the model"
            where = ", ".join(f"{name} (p={p:g})" for name, p in sorted(found.items())[:4])
            msg = (f"the evaluation logged at step {record.step} ran {whose} in eval mode, yet dropout was applied in "
                   f"{where}: a functional dropout called with training=True (F.dropout's default) does not follow "
                   f"model.eval(). Evaluation results are noisy and worse than the model's, and so is every "
                   f"prediction made with it after training.")
            out.append(self.make(record.step, msg, max(found.values()), 0.0, ", ".join(sorted(found)), ["persistent"]))
        return out
