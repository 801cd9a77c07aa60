"""Histogram probe: counts sum to the element count, bins equal ``torch.histogram`` on the same
edges, edges stay fixed, clipped values are clamped and counted, keys follow the groups."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from trackdiag import Diagnostics
from trackdiag.capture.components import build_components
from trackdiag.capture.context import ProbeContext
from trackdiag.core.errors import ConfigError
from trackdiag.probes.histograms import HistogramProbe
from trackdiag.core.record import Record
from trackdiag.core.record import read_records
from trackdiag.util.transfer import to_host


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 36, 10))


def _run(probe: HistogramProbe, model: nn.Module, kind: str) -> Record:
    """One due step of ``probe`` through the session's collect -> one host copy -> publish path."""
    comps = build_components(model, torch.optim.SGD(model.parameters(), lr=0.1), 64)
    ctx = ProbeContext(comps, every=1, layer_budget=64)
    probe.bind(1)
    probe.kinds = [kind]  # this test looks at one kind at a time
    if kind == "grad":  # gradients are binned when the step consumes them; parameters at the logging step
        probe.on_grads(ctx, comps[0], None)
    record = Record(step=0)
    probe.publish(ctx, to_host(probe.collect(ctx)), record)
    return record


def _values(model: nn.Module, kind: str) -> dict[str, torch.Tensor]:
    """The flattened values of each layer (groups == layers for this small model)."""
    out: dict[str, list[torch.Tensor]] = {}
    for name, p in model.named_parameters():
        t = p.grad if kind == "grad" else p.detach()
        out.setdefault(name.rpartition(".")[0], []).append(t.reshape(-1))
    return {k: torch.cat(v) for k, v in out.items()}


def _backward(model: nn.Module, scale: float = 1.0) -> None:
    model.zero_grad()
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    (model(x).square().mean() * scale).backward()


@pytest.mark.parametrize("kind", ["grad", "param"])
@pytest.mark.parametrize("scale", ["linear", "symlog"])
def test_counts_match_torch_histogram(kind: str, scale: str) -> None:
    model = _model()
    _backward(model)
    probe = HistogramProbe(bins=32, scale=scale)
    record = _run(probe, model, kind)
    values = _values(model, kind)
    assert sorted(record.histograms) == sorted(f"diag/{kind}/hist/{g}" for g in values)
    for group, x in values.items():
        h = record.histograms[f"diag/{kind}/hist/{group}"]
        assert len(h.edges) == len(h.counts) + 1 == 33
        assert sum(h.counts) == x.numel()
        edges = torch.tensor(h.edges, dtype=torch.float32)
        assert bool((edges[1:] > edges[:-1]).all())
        # first due step: the edges were fixed from these values, so nothing is clipped
        ref = torch.histogram(x, bins=edges).hist
        if scale == "symlog":  # binned by searching the published edges: exactly torch.histogram
            assert h.counts == ref.tolist(), group
            assert torch.equal(edges, -edges.flip(0))
        else:  # binned by histc's arithmetic on CPU: exactly histc, torch.histogram up to float rounding
            assert h.counts == torch.histc(x, 32, h.edges[0], h.edges[-1]).tolist(), group
            moved = float((torch.tensor(h.counts, dtype=torch.float64) - ref).abs().sum())
            near = int(((x[:, None] - edges[None, :]).abs() <= 1e-6 * float(edges.abs().max())).any(1).sum())
            assert moved <= 2 * near, (group, moved, near)
    assert not record.tables


def test_edges_fixed_and_outliers_clamped_and_counted() -> None:
    model = _model()
    _backward(model)
    probe = HistogramProbe(bins=16)
    first = _run(probe, model, "grad")
    _backward(model, scale=50.0)  # later gradients far outside the first step's range
    second = _run(probe, model, "grad")
    values = _values(model, "grad")
    clipped = second.tables["diag/grad/hist_clipped"]
    for group, x in values.items():
        key = f"diag/grad/hist/{group}"
        h = second.histograms[key]
        assert h.edges == first.histograms[key].edges  # comparable across steps
        edges = torch.tensor(h.edges)
        assert sum(h.counts) == x.numel()
        ref = torch.histogram(x.clamp(edges[0], edges[-1]), bins=edges).hist  # clamp into end bins
        assert h.counts == ref.tolist()
        outside = int(((x < edges[0]) | (x >= edges[-1])).sum())
        assert clipped.get(group, 0.0) == outside
    assert sum(clipped.values()) > 0


def test_options_validated() -> None:
    with pytest.raises(ConfigError) as err:
        HistogramProbe(bins=1000, scale="log", max_groups=0)
    text = str(err.value)
    assert "bins" in text and "'log'" in text and "max_groups" in text


def test_session_keys_groups_and_components(tmp_path) -> None:
    torch.manual_seed(0)
    g, d = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4)), nn.Linear(4, 1)
    opts = {"G": torch.optim.SGD(g.parameters(), lr=0.1), "D": torch.optim.SGD(d.parameters(), lr=0.1)}
    diag = Diagnostics({"G": g, "D": d}, opts, level="basic", every=2, output_dir=str(tmp_path),
                       probes={"histograms": {"bins": 8, "max_groups": 1}})
    with diag:
        for _ in range(3):
            for opt in opts.values():
                opt.zero_grad()
            loss = d(g(torch.randn(5, 4))).mean()
            loss.backward()
            for opt in opts.values():
                opt.step()
            diag.step({"G": loss.detach(), "D": loss.detach()})
    recs = [r for r in read_records(tmp_path) if r.histograms]
    assert [r.step for r in recs] == [0, 2]
    keys = set(recs[-1].histograms)
    # two layers coarsened into one group; the single-layer model is its root
    assert keys == {"diag/G/grad/hist/all", "diag/G/param/hist/all", "diag/D/grad/hist/(root)", "diag/D/param/hist/(root)"}
    n_g = sum(p.numel() for p in g.parameters())
    assert sum(sum(h.counts) for k, h in recs[-1].histograms.items() if k.startswith("diag/G/param/")) == n_g


def test_later_steps_take_the_histc_path_and_still_count_everything() -> None:
    """After the first due step the linear edges are known on the host and binning goes through
    ``histc``: counts equal ``torch.histogram(range=...)`` on the clamped values (NaN and +Inf in the
    last bin, -Inf in the first), every value is counted, clipped ones are reported."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), *[nn.Linear(256, 256) for _ in range(3)], nn.Linear(256, 4))
    _ = _run(probe := HistogramProbe(bins=24, max_groups=64), _step(model), "grad")
    assert probe._ranges, "the first publish hands the edges to the fast path"
    _step(model, scale=30.0)
    g = model[2].weight.grad
    g[0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    record = _run(probe, model, "grad")
    clipped = record.tables["diag/grad/hist_clipped"]
    for group, x in _values(model, "grad").items():
        h = record.histograms[f"diag/grad/hist/{group}"]
        lo, hi = h.edges[0], h.edges[-1]
        assert sum(h.counts) == x.numel()
        ref_x = torch.where(torch.isnan(x), torch.tensor(hi), x).clamp(lo, hi)
        ref = torch.histogram(ref_x, bins=24, range=(lo, hi)).hist
        assert h.counts == ref.tolist(), group
        outside = int(((x < lo) | (x > hi) | torch.isnan(x)).sum())
        assert clipped.get(group, 0.0) == outside, group


def _step(model: nn.Module, scale: float = 1.0) -> nn.Module:
    model.zero_grad()
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(2))
    (model(x).square().mean() * scale).backward()
    return model
