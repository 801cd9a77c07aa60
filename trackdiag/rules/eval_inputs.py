"""``eval_input_shift``: evaluation inputs on another scale than the training inputs (the ``eval_inputs`` probe)."""
from __future__ import annotations

from typing import Any, Sequence

from trackdiag.core.alert import Alert
from trackdiag.core.record import Record
from trackdiag.rules.base import Rule

SCALE = "data/eval_input_scale"
OFFSET = "data/eval_input_offset"


def shifted(scale: float, offset: float, ratio: float, offset_max: float) -> bool:
    """Whether an evaluation's inputs are off the training inputs' scale (``ratio`` either way) or centre."""
    return scale > ratio or scale < 1.0 / ratio or offset > offset_max


def input_shift_in(record: Record, ratio: float = 2.5, offset_max: float = 2.0) -> bool:
    """Whether ``record`` (a ``log_eval``'s) says a component's evaluation inputs are shifted (for other rules:
    ``overfitting`` leaves such a validation loss alone)."""
    for key, scale in record.scalars.items():
        if key.endswith(SCALE):
            offset = record.scalars.get(key[:-len(SCALE)] + OFFSET, 0.0)
            if shifted(scale, offset, ratio, offset_max):
                return True
    return False


class EvalInputShift(Rule):
    """Fires at a ``log_eval`` whose evaluation calls got inputs whose per-feature spread is over ``ratio`` (2.5)
    times, or under 1/``ratio`` times, the training calls' (the median over features), or whose per-feature means
    sit over ``offset`` (2) training standard deviations away: the validation data skipped (or got another)
    normalisation. Augmentation does not come near (mixup narrows the training spread by at most ~1.4x, input noise
    of the signal's own size by 1.4x). ``step``: the evaluation's; ``persistent`` (a warning). Once per component."""

    kind = "eval_input_shift"
    hint = ("Prepare the validation inputs exactly as the training inputs: the same Normalize(mean, std) in both "
            "transforms, the scaler fitted on the training split applied to the validation split (transform, not "
            "fit_transform or nothing), the same / 255. A distribution shift meant by design (another domain): "
            "diag.rules.eval_input_shift.enabled=false.")

    def __init__(self, *, ratio: float = 2.5, offset: float = 2.0, **kw: Any) -> None:
        super().__init__(**kw)
        self.ratio, self.offset = ratio, offset
        self._fired: set[str] = set()

    def check_eval(self, record: Record, history: Sequence[Record]) -> list[Alert]:
        out = []
        for key, scale in record.scalars.items():
            if not key.endswith(SCALE):
                continue
            offset = record.scalars.get(key[:-len(SCALE)] + OFFSET, 0.0)
            comp = key[len("diag/"):-len(SCALE)].rstrip("/")
            if comp in self._fired or not shifted(scale, offset, self.ratio, self.offset):
                continue
            self._fired.add(comp)
            whose = f"component {comp!r}" if comp else "the model"
            if scale > self.ratio or scale < 1.0 / self.ratio:
                what = f"spread {scale:.3g}x the training inputs' (per feature, median)"
            else:
                what = f"means {offset:.3g} training standard deviations away from the training inputs' (per feature, median)"
            msg = (f"the evaluation logged at step {record.step} gave {whose} inputs with a {what}: the validation "
                   f"data is not prepared as the training data is (a normalisation applied to one split only). The "
                   f"validation loss measures the model on inputs it never saw; it is not overfitting.")
            out.append(self.make(record.step, msg, scale, self.ratio, "eval inputs", ["persistent"]))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"fired": sorted(self._fired)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._fired = set(state.get("fired", []))
