"""``clip_grad_norm_`` answered from the gradient tap's norms (trackdiag.capture.clip_serve): the same bits as torch's
function, or torch's function itself.

Each training runs twice from one seed, bare and under a session, and every weight, every returned norm and the
every-step gradient norm are compared bitwise with the bare run's torch arithmetic; ``counts`` says which calls the
tap answered, so a test of the served path fails when nothing was served, and a fall-back test fails when something was.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from _harness import local_session, one_thread
from trackdiag.capture import clip_serve
from trackdiag.core.record import read_records

STEPS = 30


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(20, 48), nn.Tanh(), nn.Linear(48, 48), nn.ReLU(), nn.Linear(48, 5))


def _train(out: Path | None, level: str = "basic", *, clip: Callable[[nn.Module], Any] | None = None,
           before_clip: Callable[[nn.Module, int], None] | None = None, opt_cls: Any = torch.optim.SGD,
           micro: int = 1, freeze_first: bool = False,
           extra: Callable[[nn.Module, int], Any] | None = None,
           device: str = "cpu", make: Callable[[], nn.Module] = _model) -> tuple[nn.Module, list[torch.Tensor], Any]:
    """A classifier trained ``STEPS`` steps; ``clip(model)`` after the backward passes (default: every parameter
    to 0.5); ``before_clip(model, step)`` between the backward and the clip. A session writes to ``out`` unless
    None; ``extra(model, step)`` is added to the loss. Returns the model, the clip's return values and the session."""
    torch.manual_seed(0)
    model = make().to(device)
    if freeze_first:
        model[0].requires_grad_(False)
    opt = opt_cls([p for p in model.parameters() if p.requires_grad], lr=0.05)
    gen = torch.Generator().manual_seed(1)
    clip = clip or (lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5))
    diag = local_session(model, opt, out, level) if out is not None else None
    returned = []
    if diag is not None:
        diag.__enter__()
    try:
        for step in range(STEPS):
            opt.zero_grad(set_to_none=True)
            for _ in range(micro):
                x = torch.randn(32, 20, generator=gen).to(device)
                out_ = model(x)
                loss = F.cross_entropy(out_, (x[:, :5]).argmax(1)) / micro
                if extra is not None:
                    loss = loss + extra(model, step)
                loss.backward()
            if before_clip is not None:
                before_clip(model, step)
            returned.append(clip(model))
            opt.step()
            if diag is not None:
                diag.step(loss, outputs=out_, batch=x)
    finally:
        if diag is not None:
            diag.__exit__(None, None, None)
    return model, returned, diag


def _same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def _norms(out: Path) -> dict[int, float]:
    return {s: v for r in read_records(out) for k, s, v in r.points() if k == "diag/grad/global_norm"}


def _served(run: Callable[[], Any]) -> tuple[Any, int, int]:
    before = dict(clip_serve.counts)
    result = run()
    return result, clip_serve.counts["served"] - before["served"], clip_serve.counts["torch"] - before["torch"]


@pytest.mark.parametrize("level", ["basic", "advanced"])
@pytest.mark.parametrize("case", ["sgd", "adam", "accumulate", "frozen_layer", "unclipped"])
def test_served_clip_is_torchs_to_the_bit(tmp_path, level: str, case: str) -> None:
    """Weights, returned norms and the every-step gradient norm equal the bare run's torch arithmetic bit for bit,
    and the tap answered the calls of the plain steps (``advanced``'s detail steps, every 10th, go to torch)."""
    kw: dict[str, Any] = {"adam": {"opt_cls": torch.optim.Adam}, "accumulate": {"micro": 3},
                          "frozen_layer": {"freeze_first": True},
                          "unclipped": {"clip": lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), math.inf)}
                          }.get(case, {})
    with one_thread():
        bare, bare_ret, _ = _train(None, **kw)
        (model, ret, _), served, unserved = _served(lambda: _train(tmp_path, level, **kw))
    assert _same(bare, model)
    assert all(torch.equal(a, b) for a, b in zip(bare_ret, ret))
    assert served >= STEPS - 2, (served, unserved)  # all but the first call (it arms the component) and one more
    norms = _norms(tmp_path)
    assert sorted(norms) == list(range(STEPS))
    assert all(norms[s] == float(bare_ret[s]) for s in range(STEPS))


def _deep() -> nn.Module:
    """70 parameter tensors: past the 64 that the CPU measures with one ``_foreach_norm`` on a plain pass."""
    return nn.Sequential(nn.Linear(20, 24), *[nn.Sequential(nn.Linear(24, 24), nn.Tanh()) for _ in range(33)],
                         nn.Linear(24, 5))


def test_a_model_of_many_tensors_is_served_where_its_pass_took_per_tensor_norms(tmp_path) -> None:
    """On the CPU a plain pass of more than 64 tensors takes ``global_norm``'s way (no per-tensor norms): those
    steps' clips are torch's; the detail steps (``advanced``: every 10th and the first 10) take ``_foreach_norm``
    and are served. The training is the bare one's, bit for bit."""
    assert sum(1 for _ in _deep().parameters()) == 70
    with one_thread():
        bare, bare_ret, _ = _train(None, make=_deep)
        (model, ret, _), served, unserved = _served(lambda: _train(tmp_path, "advanced", make=_deep))
    assert _same(bare, model)
    assert all(torch.equal(a, b) for a, b in zip(bare_ret, ret))
    assert 10 <= served < STEPS - 10 and served + unserved == STEPS, (served, unserved)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("level", ["basic", "advanced"])
def test_served_clip_is_torchs_to_the_bit_on_cuda(tmp_path, level: str) -> None:
    """On CUDA ``_foreach_norm`` is a multi-tensor kernel (the CPU's loops over tensors): the per-tensor norms of the
    tap's list and of the clip's list are still the same bits."""
    bare, bare_ret, _ = _train(None, device="cuda", opt_cls=torch.optim.Adam)
    (model, ret, _), served, _ = _served(lambda: _train(tmp_path, level, device="cuda", opt_cls=torch.optim.Adam))
    assert _same(bare, model)
    assert all(torch.equal(a, b) for a, b in zip(bare_ret, ret))
    assert served >= STEPS * 0.6


def test_a_served_clip_reads_no_gradient_again(tmp_path) -> None:
    """The op count of one served call: no per-tensor norm (torch's reads every gradient with ``_foreach_norm`` or a
    ``linalg_vector_norm`` per tensor), one ``stack``, one ``linalg_vector_norm`` of the stacked norms."""
    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    seen: list[list[str]] = []

    def clip(m: nn.Module) -> torch.Tensor:
        with Ops() as ops:
            r = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
        seen.append(ops.names)
        return r

    with one_thread():
        _train(tmp_path, "basic", clip=clip)
    torch_call = seen[0]  # the first call arms the component: torch's own
    assert "_foreach_norm" in torch_call or torch_call.count("linalg_vector_norm") > 1
    late = seen[-1]
    assert "_foreach_norm" not in late and late.count("linalg_vector_norm") == 1 and late.count("stack") == 1, late


def _nan_gradient(model: nn.Module, step: int) -> torch.Tensor:
    """0 added to the loss; at step 12 its gradient is NaN (sqrt's infinite slope at 0 times abs's 0 there)."""
    if step != 12:
        return torch.zeros(())
    w = model[2].weight[0, 0]
    return (w - w.detach()).abs().sqrt()


def _sanitise(model: nn.Module, step: int) -> None:
    """A loop's guard: a gradient that is not finite is zeroed (written to only then)."""
    for p in model.parameters():
        if not torch.isfinite(p.grad).all():
            p.grad.zero_()


@pytest.mark.parametrize("change", ["nan_to_num", "clip_value", "subset", "norm_inf", "error_if_nonfinite", "foreach_false",
                                    "foreach_true", "other_model"])
def test_anything_else_goes_to_torch(tmp_path, change: str) -> None:
    """Gradients written to between the pass and the clip, another norm, torch's own options, parameters the
    session does not hold: torch's function, the same training; a subset of one component's parameters is served
    (its norm is not the step's)."""
    other = nn.Linear(3, 3)

    def with_other(m: nn.Module) -> torch.Tensor:  # a model of no session, its gradients fresh at every call
        other.zero_grad()
        other(torch.ones(1, 3)).sum().backward()
        return torch.nn.utils.clip_grad_norm_([*m.parameters(), *other.parameters()], 0.5)

    changes: dict[str, dict[str, Any]] = {
        "nan_to_num": {"before_clip": lambda m, s: [torch.nan_to_num_(p.grad) for p in m.parameters()]},
        "clip_value": {"before_clip": lambda m, s: torch.nn.utils.clip_grad_value_(m.parameters(), 1e-3)},
        "subset": {"clip": lambda m: torch.nn.utils.clip_grad_norm_(m[2].parameters(), 0.1)},
        "norm_inf": {"clip": lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5, norm_type=math.inf)},
        "error_if_nonfinite": {"clip": lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5, error_if_nonfinite=True)},
        "foreach_false": {"clip": lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5, foreach=False)},
        "foreach_true": {"clip": lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5, foreach=True)},
        "other_model": {"clip": with_other},
    }
    with one_thread():
        bare, bare_ret, _ = _train(None, **changes[change])
        (model, ret, _), served, unserved = _served(lambda: _train(tmp_path, "basic", **changes[change]))
    assert _same(bare, model)
    assert all(torch.equal(a, b) for a, b in zip(bare_ret, ret))
    if change == "subset":
        assert served >= STEPS - 3
        norms = _norms(tmp_path)  # the step's norm is every gradient's, not the clipped subset's
        assert all(norms[s] > float(ret[s]) for s in range(STEPS))
    else:
        assert served == 0 and unserved == STEPS, (served, unserved)


def test_a_nan_sanitised_before_the_clip_is_still_named_at_its_step(tmp_path) -> None:
    """A loop that zeroes non-finite gradients before clipping: the tap measured them before, the clip at that step
    is torch's (a gradient was written to), the NaN is raised at its step; the other steps are served."""
    with one_thread():
        (_, ret, diag), served, _ = _served(lambda: _train(tmp_path, "basic", before_clip=_sanitise, extra=_nan_gradient))
    assert math.isfinite(float(ret[12]))
    first = min((a for a in diag.alerts if a.kind == "nonfinite_grad"), key=lambda a: a.step)
    assert first.step == 12
    assert served == STEPS - 2, served  # all but the first call (it arms the component) and step 12


def test_the_patch_lives_with_the_sessions(tmp_path) -> None:
    """``torch.nn.utils.clip_grad_norm_`` is trackdiag's while a session is open and torch's after the last closes."""
    assert torch.nn.utils.clip_grad_norm_ is clip_serve.TORCH_CLIP
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with local_session(model, opt, tmp_path, "basic"):
        assert torch.nn.utils.clip_grad_norm_ is clip_serve.clip_grad_norm_
        assert torch.nn.utils.clip_grad.clip_grad_norm_ is clip_serve.clip_grad_norm_
    assert torch.nn.utils.clip_grad_norm_ is clip_serve.TORCH_CLIP
    assert torch.nn.utils.clip_grad.clip_grad_norm_ is clip_serve.TORCH_CLIP


def test_no_gradient_outlives_its_step_when_the_loop_clips(tmp_path) -> None:
    """A served pass keeps the gradients' list until the optimizer takes the step (the clip is behind then): once
    the loop drops its gradients (``zero_grad(set_to_none=True)``) weak references to them die."""
    import gc
    import weakref

    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with local_session(model, opt, tmp_path, "basic") as diag:
        for step in range(6):
            out = model(torch.randn(32, 20))
            loss = out.square().mean()
            loss.backward()
            before = clip_serve.counts["served"]
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            grads = [weakref.ref(p.grad) for p in model.parameters()]
            opt.step()
            diag.step(loss)
            opt.zero_grad(set_to_none=True)
        assert clip_serve.counts["served"] == before + 1  # the last step's clip was served
        del out, loss
        gc.collect()
        assert all(g() is None for g in grads), "a gradient is kept alive past zero_grad"
