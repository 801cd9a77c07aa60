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


def test_converged_lbfgs_and_an_expert_no_token_reached_are_not_stale(tmp_path) -> None:
    """Two healthy corpus runs the cut-off and 'updates do not land' warnings misread: L-BFGS skips its update once
    its own tolerances say converged (weights still from step 50: was a warning at 50 on both seeds), and a top-1
    mixture of experts whose expert 2 no token was routed to (seed 1: two warnings at step 0) is a branch the forward
    routes around, not a layer cut off. Both stay info at most."""
    from _styles import load

    for style, seed in (("lbfgs_closure", 0), ("moe_top1", 1)):
        run = load(style).run(tmp_path / style, level="advanced", seed=seed, steps=300)
        assert [a for a in run.diag.alerts if a.kind == "stale_params" and a.severity != "info"] == [], style


def test_a_frozen_backbone_on_shuffled_labels_names_the_labels_too(tmp_path) -> None:
    """A backbone frozen on purpose, trained on shuffled labels (the corpus's finetune_frozen): the loss stalls at
    chance, which a fine-tuning slip also does; the stall warning says the chance level and names the labels."""
    from _styles import load

    run = load("finetune_frozen").run(tmp_path, level="advanced", seed=0, steps=120, fault="shuffled_labels")
    stalls = [a for a in run.diag.alerts if a.kind == "stale_params" and a.severity != "info"]
    assert stalls and "chance level" in stalls[0].message and "labels" in stalls[0].message, stalls
