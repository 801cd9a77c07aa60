"""Issue 45 item 3: cut-off and frozen parameters are warnings when the evidence says so.

- A stray ``.detach()`` after the second of four layers: fc1 and fc2 never receive a gradient while
  their one optimizer steps at every step and the rest trains. Before: ``stale_params`` at info.
- ``requires_grad=False`` on all but the last layer by mistake (98% of the optimised values frozen) on a
  randomly initialised net: the loss stalls. Before: ``stale_params`` (frozen) at info only.
Healthy twins raise nothing of warning or worse from ``stale_params``: the same net fine-tuned on purpose
(a pretrained backbone frozen, a new head; the loss falls), and greedy layer-wise pretraining from the
style corpus (one optimizer per layer: later layers wait for their phase).
"""
from __future__ import annotations

from _silent_loops import loud, run, said


def test_detached_middle_layer_is_a_warning(tmp_path) -> None:
    diag, losses = run(tmp_path, "detached")
    assert losses[-1] < losses[0]  # the rest trains
    found = loud(diag, "stale_params")
    assert {a.where for a in found} == {"fc1", "fc2"}, said(diag)
    assert all(a.step <= 100 for a in found) and "cut off" in found[0].message


def test_most_frozen_with_a_stalled_loss_is_a_warning(tmp_path) -> None:
    diag, losses = run(tmp_path, "frozen_most")
    found = loud(diag, "stale_params")
    assert len(found) == 1 and found[0].step <= 100, said(diag)
    assert "frozen" in found[0].message and "stalls" in found[0].message
    assert found[0].value > 0.9  # the share of the optimised values frozen


def test_deliberate_fine_tuning_stays_quiet(tmp_path) -> None:
    diag, losses = run(tmp_path, "finetune")
    assert sum(losses[-20:]) / 20 < 0.5 * losses[0]  # it learns
    assert [a for a in diag.alerts if a.kind == "stale_params"], said(diag)  # the frozen backbone is said, as info
    assert loud(diag) == [], said(diag)


def test_greedy_layerwise_stays_quiet(tmp_path) -> None:
    from _styles import greedy_layerwise

    res = greedy_layerwise.run(tmp_path, level="advanced", seed=0, steps=240)
    assert any(a.kind == "stale_params" for a in res.diag.alerts)  # later layers wait: said, as info
    assert [a for a in res.alerts() if a.kind == "stale_params"] == [], said(res.diag)
