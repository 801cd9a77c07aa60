"""Loops written as public examples write them, shrunk to CPU size, that misled the rules (an acceptance rehearsal on
scripts no rule was calibrated on, 2026-12-03):

- pytorch/examples' ``word_language_model``: a 2-layer LSTM, truncated BPTT, no optimizer (``p.data.add_(p.grad,
  alpha=-lr)`` at lr 20, clipped at 0.25), outputs and targets flattened to ``(T*B, C)`` and ``(T*B,)``. On a corpus of
  near-uniform token frequencies it rests ~200 steps at their entropy before it learns from the context. Before: a
  critical ``not_learning`` at step 60-100 on every healthy run ("no better than a model that ignores its input"), the
  task not known to be a language model in that layout; once known, ``mode_collapse`` (a unigram model predicts its
  most frequent token everywhere).
- pytorch/examples' ``mnist`` with a ``.detach()`` after its convolutions: they never train while the dense layers
  learn (92 % accuracy), 1.6 % of the values. Before: ``stale_params`` at info (a cut under 5 % of the values read as
  an unused module).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trackdiag
from _zoo_a import digits, one_thread  # noqa: F401 (fixture)

NTOKENS, BPTT, BATCH = 200, 20, 20


def _corpus(n: int, seed: int = 1234) -> torch.Tensor:
    """An order-2 Markov chain over ``NTOKENS`` tokens with near-uniform token frequencies (4 successors per context)."""
    g = torch.Generator().manual_seed(seed)
    succ = torch.randint(0, NTOKENS, (4, NTOKENS, 4), generator=g)
    cum = torch.distributions.Dirichlet(torch.full((4,), 0.5)).sample((4, NTOKENS)).cumsum(-1)
    u = torch.rand(n, generator=g)
    out, a, b = torch.empty(n, dtype=torch.long), 0, 1
    for i in range(n):
        c = int(succ[a % 4, b, min(int(torch.searchsorted(cum[a % 4, b], u[i])), 3)])
        out[i], a, b = c, b, c
    return out


class RNNModel(nn.Module):
    """word_language_model's RNNModel (LSTM), shrunk: embedding -> dropout -> LSTM -> dropout -> decoder."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.2)
        self.encoder = nn.Embedding(NTOKENS, 32)
        self.rnn = nn.LSTM(32, 64, 2, dropout=0.2)
        self.decoder = nn.Linear(64, NTOKENS)
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)

    def forward(self, x: torch.Tensor, hidden: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, tuple]:
        out, hidden = self.rnn(self.drop(self.encoder(x)), hidden)
        return F.log_softmax(self.decoder(self.drop(out)).view(-1, NTOKENS), dim=1), hidden


@pytest.mark.parametrize("level", ["basic", "advanced"])
def test_word_language_model_resting_at_its_token_frequencies_is_no_alarm(tmp_path, level: str) -> None:
    torch.manual_seed(0)
    steps = 200 if level == "basic" else 130
    data = _corpus((steps * BPTT + 1) * BATCH)
    data = data[: (len(data) // BATCH) * BATCH].view(BATCH, -1).t().contiguous()  # batchify: (T_all, B)
    model, lr = RNNModel(), 20.0
    diag = trackdiag.Diagnostics(model, None, level=level, sinks=["local"], output_dir=str(tmp_path),
                                 sink={"console": {"enabled": False}})
    losses = []
    with diag:
        hidden = (torch.zeros(2, BATCH, 64), torch.zeros(2, BATCH, 64))
        for i in range(0, steps * BPTT, BPTT):
            x, y = data[i:i + BPTT], data[i + 1:i + 1 + BPTT].reshape(-1)
            hidden = tuple(h.detach() for h in hidden)  # repackage_hidden
            model.zero_grad()
            out, hidden = model(x, hidden)
            loss = F.nll_loss(out, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-lr)
            diag.step(loss, outputs=out, batch=(x, y))
            losses.append(loss.item())
    entropy = float(-(lambda f: (f * f.log()).sum())(torch.bincount(data.reshape(-1), minlength=NTOKENS).float().div(data.numel()).clamp_min(1e-12)))
    assert abs(sum(losses[-50:]) / 50 - entropy) < 0.05 * entropy  # at rest on its token frequencies, as the example is
    assert entropy > 0.95 * math.log(NTOKENS)  # ... whose entropy is within the 5 % chance band of ln C
    loud = [a for a in diag.alerts if a.severity != "info"]
    assert loud == [], [(a.kind, a.severity, a.step, a.message) for a in loud]


def test_flattened_next_token_targets_show_a_language_model() -> None:
    """``next_token_share`` reads the language-model layout from (inputs, targets) in every layout the examples use;
    a classifier of integer inputs (token ids, one label a sample) is none."""
    from trackdiag.alerts.task import decide, next_token_share, terms

    tokens = torch.randint(0, 50, (21, 4))
    x, y = tokens[:-1], tokens[1:]  # word_language_model's get_batch: (T, B), seq-first
    assert float(next_token_share(x, y.reshape(-1))) == 1.0  # flattened targets
    assert float(next_token_share(x, y)) == 1.0
    xb, yb = x.t().contiguous(), y.t().contiguous()  # (B, T), batch-first
    assert float(next_token_share(xb, yb.reshape(-1))) == 1.0
    assert next_token_share(x, torch.randint(0, 5, (4,))) is None  # one label per sample: no sequence
    assert next_token_share(x.float(), y.reshape(-1)) is None  # float inputs: no tokens
    assert float(next_token_share(x, torch.randint(0, 50, (80,)))) < 0.2  # targets unrelated to the inputs
    logits = torch.randn(x.numel(), 50)
    got = {k: float(v) for k, v in terms(logits, (x, y.reshape(-1))).items()}
    task = decide(float(F.cross_entropy(logits, y.reshape(-1))), got, 50)
    assert task.kind == "classification" and task.next_token and task.sequence
    got = {k: float(v) for k, v in terms(logits, (x, torch.randint(0, 50, (80,)))).items()}
    task = decide(float(F.cross_entropy(logits, torch.randint(0, 50, (80,)))), got, 50)
    assert not task.next_token and not task.sequence


class MnistNet(nn.Module):
    """pytorch/examples' mnist Net, shrunk for 8x8 digits: conv1 -> conv2 -> max-pool -> dropout -> fc1 -> fc2."""

    def __init__(self, detach: bool = False, unused_head: bool = False) -> None:
        super().__init__()
        self.detach = detach
        self.conv1, self.conv2 = nn.Conv2d(1, 8, 3, 1), nn.Conv2d(8, 16, 3, 1)
        self.dropout1, self.dropout2 = nn.Dropout(0.25), nn.Dropout(0.5)
        self.fc1, self.fc2 = nn.Linear(16 * 2 * 2, 400), nn.Linear(400, 10)
        if unused_head:  # an auxiliary head defined after the layers that train and never called (a pooler)
            self.aux = nn.Linear(400, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        if self.detach:
            x = x.detach()  # the planted cut: the convolutions never train
        x = self.dropout1(torch.flatten(x, 1))
        return F.log_softmax(self.fc2(self.dropout2(F.relu(self.fc1(x)))), dim=1)


def _mnist(tmp_path, **net: bool) -> tuple[trackdiag.Diagnostics, float]:
    xtr, ytr, xva, yva = digits()
    xtr, xva = xtr.view(-1, 1, 8, 8), xva.view(-1, 1, 8, 8)
    torch.manual_seed(0)
    model = MnistNet(**net)
    opt = torch.optim.Adadelta(model.parameters(), lr=1.0)
    diag = trackdiag.Diagnostics(model, opt, level="advanced", sinks=["local"], output_dir=str(tmp_path),
                                 sink={"console": {"enabled": False}})
    g = torch.Generator().manual_seed(1)
    with diag:
        for step in range(150):
            idx = torch.randint(0, len(xtr), (64,), generator=g)
            x, y = xtr[idx], ytr[idx]
            opt.zero_grad()
            out = model(x)
            loss = F.nll_loss(out, y)
            loss.backward()
            opt.step()
            diag.step(loss, outputs=out, batch=(x, y))
            if step % 50 == 49:
                model.eval()
                with torch.no_grad():
                    acc = float((model(xva).argmax(1) == yva).float().mean())
                    diag.log_eval(loss=float(F.nll_loss(model(xva), yva)), accuracy=acc)
                model.train()
    return diag, acc


def test_mnist_example_with_its_convolutions_detached_is_a_warning(tmp_path) -> None:
    diag, acc = _mnist(tmp_path, detach=True)
    assert acc > 0.6  # the dense layers learn: nothing else looks wrong
    found = [a for a in diag.alerts if a.kind == "stale_params" and a.severity != "info"]
    assert {a.where for a in found} == {"conv1", "conv2"}, [(a.kind, a.severity, a.where, a.message) for a in diag.alerts]
    assert all(a.step <= 100 for a in found) and "first layer" in found[0].message and "cut off" in found[0].message


def test_mnist_example_with_an_unused_last_head_stays_info(tmp_path) -> None:
    """The first-layer reading concerns the input side: a module after the layers that train, never called (a pooler,
    an auxiliary head; 1.6 % of the values here too) is said as info, as before."""
    diag, acc = _mnist(tmp_path, unused_head=True)
    assert acc > 0.6
    assert any(a.kind == "stale_params" and a.where == "aux" for a in diag.alerts), [(a.kind, a.where) for a in diag.alerts]
    loud = [a for a in diag.alerts if a.severity != "info"]
    assert loud == [], [(a.kind, a.severity, a.where, a.message) for a in loud]


class Reverser(nn.Module):
    """The PyTorch translation tutorial's ``Seq2SeqTransformer`` (token embeddings x sqrt(d), sinusoidal positions,
    ``nn.Transformer``, a generator), shrunk: it learns to reverse a sequence of tokens."""

    def __init__(self, vocab: int = 16, d: int = 32) -> None:
        super().__init__()
        self.d = d
        self.src, self.tgt = nn.Embedding(vocab, d), nn.Embedding(vocab, d)
        self.transformer = nn.Transformer(d, 2, 1, 1, 64, dropout=0.1, batch_first=True)
        self.generator = nn.Linear(d, vocab)
        pos = torch.arange(32).unsqueeze(1) * torch.exp(-torch.arange(0, d, 2) * math.log(10000.0) / d)
        self.register_buffer("pe", torch.stack([pos.sin(), pos.cos()], -1).reshape(32, d))
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        n = tgt.shape[1]
        mask = torch.triu(torch.full((n, n), float("-inf")), 1)
        embed = lambda e, t: e(t) * math.sqrt(self.d) + self.pe[: t.shape[1]]  # noqa: E731
        return self.generator(self.transformer(embed(self.src, src), embed(self.tgt, tgt), tgt_mask=mask))


def _noam(tmp_path, lr1000_at: int | None, steps: int = 60) -> trackdiag.Diagnostics:
    """The tutorial's recipe: Adam at a base rate of 1, betas (0.9, 0.98), eps 1e-9, scaled by ``LambdaLR`` to
    ``d**-0.5 * min(s**-0.5, s * warmup**-1.5)`` (a linear ramp from ~0 over 200 steps), cross-entropy with label
    smoothing 0.1 on the flattened logits."""
    torch.manual_seed(0)
    model, factor = Reverser(), [1.0]
    opt = torch.optim.Adam(model.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
    sched = torch.optim.lr_scheduler.LambdaLR(  # the tutorial's rate(): step 0 counts as step 1
        opt, lambda s: factor[0] * 32 ** -0.5 * min(max(s, 1) ** -0.5, max(s, 1) * 200 ** -1.5))
    loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1)
    diag = trackdiag.Diagnostics(model, opt, level="advanced", sinks=["local"], output_dir=str(tmp_path),
                                 sink={"console": {"enabled": False}})
    g = torch.Generator().manual_seed(1)
    with diag:
        for step in range(steps):
            if step == lr1000_at:
                factor[0] = 1000.0  # planted: the schedule's factor, as a config typo would scale it
                sched.step(sched.last_epoch)  # applied at once
            src = torch.randint(2, 16, (32, 8), generator=g)
            tgt = torch.cat([torch.ones(32, 1, dtype=torch.long), src.flip(1)], 1)  # BOS (1), then the reversal
            out = model(src, tgt[:, :-1])
            loss = loss_fn(out.reshape(-1, out.shape[-1]), tgt[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            diag.step(loss, outputs=out, batch=(src, tgt))
    return diag


def test_a_warm_up_from_zero_is_no_jump_of_the_learning_rate(tmp_path) -> None:
    """The rate x11 from step 0 to step 10 and x50 by step 50 is the ramp; before: update_scale critical at step 50 on
    every healthy run of a Noam or linear warm-up at ``advanced`` ("the learning rate rose from 4.42e-05 to 0.00225"),
    the tutorial's translation transformer's and a hand-written fine-tuning loop's, which also emptied its history
    (so a real blow-up later went unsaid) and opened an incident that absorbed what followed. A x1000 planted mid-ramp
    is said at its step."""
    healthy = _noam(tmp_path / "healthy", None)
    loud = [a for a in healthy.alerts if a.severity != "info"]
    assert loud == [], [(a.kind, a.severity, a.step, a.message) for a in loud]
    planted = _noam(tmp_path / "planted", 50)
    found = [a for a in planted.alerts if a.kind == "update_scale"]
    assert found and found[0].step == 50 and found[0].severity == "critical", [(a.kind, a.step) for a in planted.alerts]


def test_a_frozen_share_short_of_all_is_not_said_as_100_percent() -> None:
    """A body frozen by mistake beside a trainable head of 0.2 % of the values (the rehearsal's fine-tuning loop: 195
    values of a classifier head): the stall's message said "100% of the values ... are frozen"; it gives the share."""
    from trackdiag.capture.components import build_components
    from trackdiag.core.record import Record
    from trackdiag.rules.stale import StaleParams

    body, head = nn.Linear(1000, 1000), nn.Linear(1000, 2)
    body.requires_grad_(False)
    model = nn.Sequential(body, head)
    comp = build_components(model, torch.optim.SGD(model.parameters(), lr=0.1), 64)[0]
    rule, found = StaleParams(), []
    for step in range(0, 80, 10):
        rec = Record(step=step, time=0.0)
        rec.series["diag/loss"] = [(s, 0.69) for s in range(step, step + 10)]
        if step == 0:
            rec.tables["diag/setup/frozen"] = {"0": float(body.weight.numel() + body.bias.numel())}
        found += [a for a in rule.check(rec, [], [comp]) if a.severity != "info"]
    assert len(found) == 1 and "stalls" in found[0].message, [(a.kind, a.severity, a.message) for a in found]
    assert found[0].message.startswith("99.8% of the values"), found[0].message
