"""The exact-step NaN replay (``nan_replay: {mode: step}``) reads the host once per backward pass, however many
models that pass reached: a GRU encoder and decoder with an optimizer each (PyTorch's seq2seq tutorial) read
their two gradients' finiteness together at the first optimizer's step, and the second optimizer's check
reads nothing. A fault in the second model is still judged before its own update and replayed there; two
backward passes in one step (a GAN's discriminator, then its generator) are two reads."""
from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

import trackdiag
from test_host_reads import HostReads


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding, self.gru = nn.Embedding(12, 16), nn.GRU(16, 16)

    def forward(self, token, h):
        return self.gru(self.embedding(token).view(1, 1, -1), h)


class NanGate(nn.Module):
    """Makes NaN while ``on`` (a fault in the model's own forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.on = False

    def forward(self, x):
        return x * float("nan") if self.on else x


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding, self.gru, self.out = nn.Embedding(12, 16), nn.GRU(16, 16), nn.Linear(16, 12)
        self.gate = NanGate()

    def forward(self, token, h):
        x, h = self.gru(F.relu(self.embedding(token).view(1, 1, -1)), h)
        return F.log_softmax(self.gate(self.out(x[0])), dim=1), h


def _seq2seq(tmp_path, steps: int, poison_at: int | None = None) -> tuple[trackdiag.Diagnostics, list[Counter], Decoder]:
    """One sentence per step (the target is the source reversed), both optimizers stepped after the one
    backward pass; ``poison_at``: the decoder's gate makes NaN at that step (from its 4th call)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    enc, dec = Encoder(), Decoder()
    opts = {"encoder": torch.optim.SGD(enc.parameters(), lr=0.05), "decoder": torch.optim.SGD(dec.parameters(), lr=0.05)}
    diag = trackdiag.Diagnostics({"encoder": enc, "decoder": dec}, opts, level="basic", every=5, sinks=["local"],
                                 output_dir=str(tmp_path), probes={"nan_replay": {"enabled": True, "mode": "step"}})
    seen: list[Counter] = []
    for step in range(steps):
        src = torch.randint(2, 12, (6,), generator=g)
        with HostReads() as mode:
            h = torch.zeros(1, 1, 16)
            for i in range(6):
                _, h = enc(src[i:i + 1], h)
            token, loss = src.new_zeros(1), torch.zeros(())
            for i, t in enumerate(src.flip(0)):
                dec.gate.on = poison_at == step and i >= 3
                out, h = dec(token, h)
                loss = loss + F.nll_loss(out, t.view(1))
                token = t.view(1)
            loss.backward()
            for opt in opts.values():
                opt.step()
            for opt in opts.values():
                opt.zero_grad(set_to_none=True)
            diag.step(loss)
        seen.append(mode.ops)
        if poison_at is not None and step == poison_at:
            break
    diag.close()
    return diag, seen, dec


def _replay_probe(diag: trackdiag.Diagnostics):
    return next(p for p in diag.probes if p.name == "nan_replay")


def test_one_backward_through_two_models_is_one_read(tmp_path) -> None:
    diag, seen, _ = _seq2seq(tmp_path, 12)
    # logging steps (0, 5, 10) add the session's one batched copy (no op seen here: it is a numpy copy)
    assert [dict(ops) for ops in seen] == [{"_local_scalar_dense": 1}] * 12
    assert _replay_probe(diag).reads == 12  # not 24: one per backward pass, not one per optimizer
    assert not [a for a in diag.alerts if a.severity != "info"]


def test_a_fault_in_the_second_model_is_replayed_before_its_update(tmp_path) -> None:
    diag, seen, dec = _seq2seq(tmp_path, 12, poison_at=7)
    probe = _replay_probe(diag)
    assert probe.replays == 1 and 7 in probe.findings
    # the encoder's optimizer steps first and its check finds the pass non-finite (the NaN flowed back into it
    # through the hidden state); its own calls replay finite, so the decoder's are replayed, before either update
    comp, found = probe.findings[7]
    assert (comp, found.module, found.phase, found.input_finite) == ("decoder", "gate", "forward", True), found
    nonfinite = [a for a in diag.alerts if a.kind == "nonfinite_loss"]
    assert nonfinite[0].step == 7 and nonfinite[0].where == "decoder.gate (input finite)", nonfinite[0].where
    assert "replayed on the weights of step" not in found.detail  # exact: the weights step 7 ran on, no snapshot


def test_two_backward_passes_in_a_step_are_two_reads(tmp_path) -> None:
    """A GAN step: the discriminator's loss backward and step, then the generator's (through the
    discriminator): each pass is read before its optimizer's update."""
    torch.manual_seed(0)
    G, D = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2)), nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 1))
    oG, oD = torch.optim.Adam(G.parameters(), 1e-3), torch.optim.Adam(D.parameters(), 1e-3)
    diag = trackdiag.Diagnostics({"G": G, "D": D}, {"G": oG, "D": oD}, level="basic", every=5, sinks=["local"],
                                 output_dir=str(tmp_path), probes={"nan_replay": {"enabled": True, "mode": "step"}})
    bce = nn.BCEWithLogitsLoss()
    for _ in range(10):
        real, z = torch.randn(32, 2) * 0.5 + 1.0, torch.randn(32, 4)
        fake = G(z)
        loss_d = bce(D(real), torch.ones(32, 1)) + bce(D(fake.detach()), torch.zeros(32, 1))
        oD.zero_grad()
        loss_d.backward()
        oD.step()
        loss_g = bce(D(fake), torch.ones(32, 1))
        oG.zero_grad()
        loss_g.backward()  # reaches D's parameters too: a newer pass than the one D's step was judged on
        oG.step()
        diag.step({"D": loss_d, "G": loss_g})
    diag.close()
    assert _replay_probe(diag).reads == 20
    assert not [a for a in diag.alerts if a.severity != "info"]
