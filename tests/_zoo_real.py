"""The real-code fault zoo: four training scripts in the styles users write, each runnable healthy
or with one planted fault, with trackdiag wired in the way the README says.

Scripts: ``wordlm`` (PyTorch's word_language_model: LSTM, hand-written SGD at lr 20, clipping at
0.25, no optimizer object), ``chargpt`` (nanoGPT: AdamW with decay groups, warm-up, clipping at 1.0,
4 micro-batches per step), ``cnn`` (digits CNN with BatchNorm and dropout, SGD with momentum,
validation every 20 steps), ``names`` (a names generator: GRU, targets padded with -1 and
``cross_entropy(..., ignore_index=-1)``, Adam).

Faults (``FAULTS``): ``lr_start``/``lr_mid`` (learning rate x1000 from step 0 / from ``onset``),
``init100``/``init100_noclip`` (weights x100 at init, clipping kept / removed), ``nan`` (log(0)
inside a named module from ``onset``), ``no_zero`` (zero_grad dropped from ``onset``),
``freeze_before``/``freeze_after`` (a block frozen before / after the optimizer is built, the
optimizer still given all parameters), ``left_out`` (a layer left out of the optimizer),
``labels_eq_inputs`` (targets equal to the inputs), ``tiny_subset`` (training on one or two batches:
overfitting), ``leak`` (``backward(retain_graph=True)`` and the loss kept in a list every step: its
graph's saved activations stay alive). Each script says which faults
it cannot have (``NOT_APPLICABLE``) and why.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

import trackdiag
from _loops import (CharGPT, DigitsCNN, NamesModel, WordLM, batchify, char_batches, char_data, gpt_optimizer,
                    lm_batches, names_batches, names_data, repackage, warmup_cosine, word_data)
from _harness import Judged, local_session, one_thread
from _zoo_a import digits

FAULTS = ("lr_start", "lr_mid", "init100", "init100_noclip", "nan", "no_zero", "freeze_before", "freeze_after",
          "left_out", "labels_eq_inputs", "tiny_subset", "leak")
START_FAULTS = {"lr_start", "init100", "init100_noclip", "freeze_before", "freeze_after", "left_out", "labels_eq_inputs", "tiny_subset"}
ONSET = 40


class Gate(nn.Module):
    """Wraps a module; when the ``fault`` buffer is 1 its output goes through log(0) (-inf/NaN).
    A buffer, so the switch survives a replay on earlier weights and costs no recompile."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.register_buffer("fault", torch.zeros(()), persistent=False)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.inner(*args, **kwargs)
        if isinstance(out, tuple):
            return (out[0] + torch.log1p(-self.fault), *out[1:])
        return out + torch.log1p(-self.fault)


@dataclasses.dataclass
class Run(Judged):
    diag: Any
    onset: int
    steps: int
    culprit: str = ""  # the module a `nan` fault is planted in


def session(model: Any, opt: Any, out: Any, level: str, every: int, **kw: Any) -> trackdiag.Diagnostics:
    return local_session(model, opt, out, level, every=every, **kw)


def scale_weights(model: nn.Module, factor: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(factor)


# ----------------------------------------------------------------------------- word LM
def wordlm(fault: str | None, out: Any, steps: int = 300, onset: int = ONSET, level: str = "advanced",
           every: int = 10) -> Run:
    data, ntok = word_data()
    torch.manual_seed(0)
    model = WordLM(ntok)
    model.rnn = Gate(model.rnn)
    if fault in ("init100", "init100_noclip"):
        scale_weights(model, 100.0)
    lr, clip = 20.0, 0.25
    train = batchify(data[: int(0.9 * len(data))], 16)
    if fault == "tiny_subset":
        train = train[:22]
    batches = lm_batches(train, 20)
    kept: list[torch.Tensor] = []
    diag = session(model, None, out, level, every)
    with one_thread(), diag:
        hidden = model.init_hidden(16)
        for step in range(steps):
            x, y = next(batches)
            if fault == "labels_eq_inputs":
                y = x
            model.rnn.fault.fill_(1.0 if fault == "nan" and step >= onset else 0.0)
            step_lr = lr * (1000 if fault == "lr_start" or (fault == "lr_mid" and step >= onset) else 1)
            hidden = repackage(hidden)
            if not (fault == "no_zero" and step >= onset):
                model.zero_grad()
            output, hidden = model(x, hidden)
            loss = F.cross_entropy(output.view(-1, ntok), y.reshape(-1))
            loss.backward(retain_graph=fault == "leak")
            if fault != "init100_noclip":
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            for p in model.parameters():
                if p.grad is not None:
                    p.data.add_(p.grad, alpha=-step_lr)
            if fault == "leak":
                kept.append(loss)  # the classic: the loss kept with its graph
            diag.step(loss, outputs=output, batch=(x, y))
            if step % 20 == 19:
                diag.log_eval(loss=_eval_lm(model, data, ntok))
    return Run(diag, onset if fault not in START_FAULTS else 0, steps, "rnn")


@torch.no_grad()
def _eval_lm(model: WordLM, data: torch.Tensor, ntok: int) -> float:
    """word_language_model's evaluate(): the whole validation split, batch 10."""
    model.eval()
    val = batchify(data[int(0.9 * len(data)):], 10)
    hidden = model.init_hidden(10)
    out, _ = model(val[:-1], hidden)
    loss = F.cross_entropy(out.view(-1, ntok), val[1:].reshape(-1)).item()
    model.train()
    return loss


# ----------------------------------------------------------------------------- char GPT
def chargpt(fault: str | None, out: Any, steps: int = 200, onset: int = ONSET, level: str = "advanced",
            every: int = 10) -> Run:
    data, vocab = char_data()
    torch.manual_seed(0)
    model = CharGPT(vocab, block=32)
    model.h[1].attn = Gate(model.h[1].attn)
    if fault in ("init100", "init100_noclip"):
        scale_weights(model, 100.0)
    if fault == "freeze_before":
        model.h[0].requires_grad_(False)
    lr = 3e-3 * (1000 if fault == "lr_start" else 1)
    if fault == "left_out":
        opt = torch.optim.AdamW([p for n, p in model.named_parameters() if not n.startswith("h.1.mlp")], lr=lr)
    else:
        opt = gpt_optimizer(model, lr)
    if fault == "freeze_after":
        model.h[0].requires_grad_(False)
    split = int(0.9 * len(data))
    train = data[:split] if fault != "tiny_subset" else data[:300]
    batches = char_batches(train, 32, 8)
    kept: list[torch.Tensor] = []
    diag = session(model, opt, out, level, every)
    with one_thread(), diag:
        for it in range(steps):
            base = warmup_cosine(it, 3e-3, 10, steps) * (1000 if fault == "lr_start" or (fault == "lr_mid" and it >= onset) else 1)
            for g in opt.param_groups:
                g["lr"] = base
            model.h[1].attn.fault.fill_(1.0 if fault == "nan" and it >= onset else 0.0)
            total = torch.zeros(())
            for _ in range(4):
                x, y = next(batches)
                if fault == "labels_eq_inputs":
                    y = x
                logits, loss = model(x, y)
                (loss / 4).backward(retain_graph=fault == "leak")
                total = total + loss.detach() / 4
                if fault == "leak":
                    kept.append(loss)
            if fault != "init100_noclip":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if not (fault == "no_zero" and it >= onset):
                opt.zero_grad(set_to_none=True)
            diag.step(total, outputs=logits, batch=(x, y))
            if it % 20 == 19:
                diag.log_eval(loss=_eval_gpt(model, data[split:]))
    return Run(diag, onset if fault not in START_FAULTS else 0, steps, "h.1.attn")


@torch.no_grad()
def _eval_gpt(model: CharGPT, val: torch.Tensor) -> float:
    model.eval()
    x, y = next(char_batches(val, 32, 16, seed=1))
    _, loss = model(x, y)
    model.train()
    return float(loss)


# ----------------------------------------------------------------------------- CNN
def cnn(fault: str | None, out: Any, steps: int = 300, onset: int = ONSET, level: str = "advanced",
        every: int = 10) -> Run:
    xtr, ytr, xva, yva = digits()
    torch.manual_seed(0)
    model = DigitsCNN()
    model.features[3] = Gate(model.features[3])  # the second convolution
    if fault in ("init100", "init100_noclip"):
        scale_weights(model, 100.0)
    if fault == "freeze_before":
        model.features[0].requires_grad_(False)
    lr = 0.05 * (1000 if fault == "lr_start" else 1)
    params = model.parameters() if fault != "left_out" else [p for n, p in model.named_parameters() if not n.startswith("head")]
    opt = torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=5e-4)
    if fault == "freeze_after":
        model.features[0].requires_grad_(False)
    if fault == "tiny_subset":
        xtr, ytr = xtr[:64], ytr[:64]
    gen = torch.Generator().manual_seed(0)
    kept: list[torch.Tensor] = []
    diag = session(model, opt, out, level, every)
    with one_thread(), diag:
        for step in range(steps):
            if fault == "lr_mid" and step == onset:
                for g in opt.param_groups:
                    g["lr"] *= 1000
            model.features[3].fault.fill_(1.0 if fault == "nan" and step >= onset else 0.0)
            idx = torch.randint(len(xtr), (64,), generator=gen)
            x, y = xtr[idx], ytr[idx]
            if not (fault == "no_zero" and step >= onset):
                opt.zero_grad()
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            loss.backward(retain_graph=fault == "leak")
            opt.step()
            if fault == "leak":
                kept.append(loss)
            diag.step(loss, outputs=logits, batch=(x, y))
            if step % 20 == 19:
                model.eval()
                with torch.no_grad():
                    vl = F.cross_entropy(model(xva), yva).item()
                model.train()
                diag.log_eval(loss=vl)
    return Run(diag, onset if fault not in START_FAULTS else 0, steps, "features.3")


# ----------------------------------------------------------------------------- names generator
def names(fault: str | None, out: Any, steps: int = 300, onset: int = ONSET, level: str = "advanced",
          every: int = 10) -> Run:
    seqs, vocab = names_data()
    torch.manual_seed(0)
    model = NamesModel(vocab)
    model.gru = Gate(model.gru)
    if fault in ("init100", "init100_noclip"):
        scale_weights(model, 100.0)
    if fault == "freeze_before":
        model.gru.requires_grad_(False)
    lr = 3e-3 * (1000 if fault == "lr_start" else 1)
    params = model.parameters() if fault != "left_out" else [p for n, p in model.named_parameters() if not n.startswith("head")]
    opt = torch.optim.Adam(params, lr=lr)
    if fault == "freeze_after":
        model.gru.requires_grad_(False)
    batches = names_batches(32, pad=-1, seed=0)
    fixed = [next(batches) for _ in range(2)]
    val = names_batches(128, pad=-1, seed=7)
    kept: list[torch.Tensor] = []
    diag = session(model, opt, out, level, every)
    with one_thread(), diag:
        for step in range(steps):
            if fault == "lr_mid" and step == onset:
                for g in opt.param_groups:
                    g["lr"] *= 1000
            model.gru.fault.fill_(1.0 if fault == "nan" and step >= onset else 0.0)
            x, y = fixed[step % 2] if fault == "tiny_subset" else next(batches)
            if fault == "labels_eq_inputs":
                y = x
            if not (fault == "no_zero" and step >= onset):
                opt.zero_grad()
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1), ignore_index=-1)
            loss.backward(retain_graph=fault == "leak")
            if fault != "init100_noclip":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            if fault == "leak":
                kept.append(loss)
            diag.step(loss, outputs=logits, batch=(x, y))
            if step % 20 == 19:
                model.eval()
                with torch.no_grad():
                    vx, vy = next(val)
                    vl = F.cross_entropy(model(vx).reshape(-1, vocab), vy.reshape(-1), ignore_index=-1).item()
                model.train()
                diag.log_eval(loss=vl)
    return Run(diag, onset if fault not in START_FAULTS else 0, steps, "gru")


SCRIPTS: dict[str, Callable[..., Run]] = {"wordlm": wordlm, "chargpt": chargpt, "cnn": cnn, "names": names}
NOT_APPLICABLE = {
    # no optimizer object: nothing records which parameters were meant to train
    ("wordlm", "freeze_before"): "no optimizer: a frozen layer is indistinguishable from one frozen on purpose",
    ("wordlm", "freeze_after"): "no optimizer: a frozen layer is indistinguishable from one frozen on purpose",
    ("wordlm", "left_out"): "no optimizer object to leave a layer out of",
    ("cnn", "labels_eq_inputs"): "images as targets do not type-check with cross-entropy",
    # nanoGPT's configure_optimizers keeps only parameters that require a gradient: freezing a block
    # before it runs is how one freezes on purpose
    ("chargpt", "freeze_before"): "the script's optimizer takes only requires_grad parameters: frozen on purpose",
}
