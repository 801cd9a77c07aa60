"""``eval_input_shift``: evaluation inputs on another scale than the training inputs (the ``eval_inputs`` probe)."""
from __future__ import annotations

from typing import Any, Sequence

from trackdiag.capture.context import component_of
from trackdiag.core.alert import Alert
from trackdiag.core.record import Record
from trackdiag.rules.base import OncePer

SCALE = "data/eval_input_scale"
OFFSET = "data/eval_input_offset"


def rescaled(scale: float, ratio: float) -> bool:
    """Whether an evaluation's inputs are off the training inputs' scale, ``ratio`` times either way."""
    return scale > ratio or scale < 1.0 / ratio


def input_shift_in(record: Record, ratio: float = 2.5) -> bool:
    """Whether ``record`` (a ``log_eval``'s) says a component's evaluation inputs are on another scale (for other
    rules: ``overfitting`` leaves such a validation loss alone)."""
    return any(key.endswith(SCALE) and rescaled(scale, ratio) for key, scale in record.scalars.items())


class EvalInputShift(OncePer):
    """Fires at a ``log_eval`` whose evaluation calls got inputs whose per-feature spread is over ``ratio`` (2.5)
    times, or under 1/``ratio`` times, the training calls' (the median over features): the validation data skipped
    (or got another) normalisation, ``persistent`` (a warning). Augmentation does not come near (mixup narrows the
    training spread by at most ~1.4x, input noise of the signal's own size by 1.4x). Means over ``offset`` (2)
    training standard deviations away on the training spread is a shifted distribution more often than a
    preprocessing bug (a series with a trend split by time, another domain): said as info. ``step``: the
    evaluation's. Once per component; never for a component whose objective is ``rl`` (a policy evaluated greedily
    visits a narrower set of states than it trained on)."""

    kind = "eval_input_shift"
    hint = ("Prepare the validation inputs exactly as the training inputs: the same Normalize(mean, std) in both "
            "transforms, the scaler fitted on the training split applied to the validation split (transform, not "
            "fit_transform or nothing), the same / 255. A distribution shift meant by design (another domain): "
            "diag.rules.eval_input_shift.enabled=false.")

    def __init__(self, *, ratio: float = 2.5, offset: float = 2.0, **kw: Any) -> None:
        super().__init__(**kw)
        self.ratio, self.offset = ratio, offset

    def check_eval(self, record: Record, history: Sequence[Record]) -> list[Alert]:
        out = []
        for key, scale in record.scalars.items():
            if not key.endswith(SCALE):
                continue
            offset = record.scalars.get(key[:-len(SCALE)] + OFFSET, 0.0)
            comp = component_of(key, SCALE)
            scaled = rescaled(scale, self.ratio)
            if not (scaled or offset > self.offset) or self.objectives.of(comp) == "rl" or not self.first(comp):
                continue  # a policy evaluated greedily visits fewer states than it trained on: not a preprocessing bug
            whose = f"component {comp!r}" if comp else "the model"
            if scaled:
                msg = (f"the evaluation logged at step {record.step} gave {whose} inputs with a spread {scale:.3g}x the "
                       f"training inputs' (per feature, median): the validation data is not prepared as the training "
                       f"data is (a normalisation applied to one split only). The validation loss measures the model "
                       f"on inputs on a scale it never saw; it is not overfitting.")
                out.append(self.make(record.step, msg, scale, self.ratio, "eval inputs", ["persistent"]))
                continue
            msg = (f"the evaluation logged at step {record.step} gave {whose} inputs whose means sit {offset:.3g} "
                   f"training standard deviations from the training inputs' (per feature, median) on the same spread: "
                   f"another distribution (a series with a trend split by time, another domain), or an offset applied "
                   f"to one split only. The validation loss is judged on data unlike the training data.")
            out.append(self.make(record.step, msg, offset, self.offset, "eval inputs"))
        return out
