"""What the NaN replay keeps of each training forward, checked against the loop's own tensors: a GRU
encoder/decoder called once per token (the short-step seq2seq of benchmarks/seq2seq.py), two models
and two optimizers. During a step a call is one list append (the arguments as passed); when the step
ends they are kept detached (no graph, no copy), the first ``max_calls`` per model and step; the
running step's calls are there for a crash before ``step()``; the call slot outlives the zero-grad
probe's watcher on the same root and is given back at close."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import trackdiag
from trackdiag.capture.root_call import SLOT


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding, self.gru = nn.Embedding(20, 16), nn.GRU(16, 16)

    def forward(self, token: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gru(self.embedding(token).view(1, 1, -1), h)


class Decoder(Encoder):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(16, 20)

    def forward(self, token: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, h = self.gru(F.relu(self.embedding(token).view(1, 1, -1)), h)
        return F.log_softmax(self.out(x[0]), dim=1), h


def _forward(enc: Encoder, dec: Decoder, src: torch.Tensor, seen: dict[str, list]) -> torch.Tensor:
    """One sentence, the tutorial's way; ``seen`` gets each call's arguments as the loop passed them."""
    h = torch.zeros(1, 1, 16)
    for i in range(len(src)):
        seen["encoder"].append((src[i:i + 1], h))
        _, h = enc(src[i:i + 1], h)
    loss, token = torch.zeros(()), src.new_tensor([0])
    for i in range(len(src)):
        seen["decoder"].append((token, h))
        out, h = dec(token, h)
        loss = loss + F.nll_loss(out, src.flip(0)[i:i + 1])
        token = src.flip(0)[i:i + 1]
    return loss


def test_each_call_is_kept_detached_sharing_the_loops_tensors_up_to_max_calls(tmp_path):
    torch.manual_seed(0)
    enc, dec = Encoder(), Decoder()
    opts = {"encoder": torch.optim.SGD(enc.parameters(), lr=0.1), "decoder": torch.optim.SGD(dec.parameters(), lr=0.1)}
    g = torch.Generator().manual_seed(1)
    with trackdiag.Diagnostics({"encoder": enc, "decoder": dec}, opts, level="advanced", sinks=["local"],
                               output_dir=str(tmp_path), probes={"nan_replay": {"max_calls": 6}}) as diag:
        probe = next(p for p in diag.probes if p.name == "nan_replay")
        for step in range(30):
            src = torch.randint(1, 20, (int(torch.randint(4, 10, (), generator=g)),), generator=g)
            seen: dict[str, list] = {"encoder": [], "decoder": []}
            loss = _forward(enc, dec, src, seen)
            if step == 27:  # a crash here: the running step's calls are what the flight recorder replays
                running = probe.calls_of(step, "decoder")
                assert len(running) == min(len(src), 6)
            loss.backward()
            for opt in opts.values():
                opt.step()
                opt.zero_grad()
            diag.step({"encoder": loss, "decoder": loss})
            for comp in ("encoder", "decoder"):
                kept = probe.calls_of(step, comp)
                assert len(kept) == min(len(src), 6), (step, comp, len(kept))
                for (args, kwargs, amp), (token, h) in zip(kept, seen[comp]):
                    assert kwargs == {} and amp is None
                    assert torch.equal(args[0], token) and args[0].data_ptr() == token.data_ptr()
                    assert args[1].data_ptr() == h.data_ptr() and torch.equal(args[1], h)
                    assert args[1].grad_fn is None and not args[1].requires_grad  # the graph is not kept
        # the zero-grad probe's watcher on the same roots rested after 20 one-pass steps: the replay's stays
        assert SLOT in enc.__dict__ and SLOT in dec.__dict__
        assert len(probe._ring) == diag.config["every"] + 1
    assert SLOT not in enc.__dict__ and SLOT not in dec.__dict__  # given back at close


def test_calls_outside_training_are_not_kept(tmp_path):
    torch.manual_seed(0)
    enc, dec = Encoder(), Decoder()
    opts = {"encoder": torch.optim.SGD(enc.parameters(), lr=0.1), "decoder": torch.optim.SGD(dec.parameters(), lr=0.1)}
    with trackdiag.Diagnostics({"encoder": enc, "decoder": dec}, opts, level="advanced", sinks=["local"],
                               output_dir=str(tmp_path)) as diag:
        probe = next(p for p in diag.probes if p.name == "nan_replay")
        src = torch.tensor([3, 4, 5])
        seen: dict[str, list] = {"encoder": [], "decoder": []}
        with torch.no_grad():  # validation inside the step: no graph, nothing to replay
            _forward(enc, dec, src, seen)
        enc.eval()
        _forward(enc, dec, src, seen)  # the encoder in eval mode: only the decoder's calls count
        enc.train()
        loss = _forward(enc, dec, src, seen)
        loss.backward()
        for opt in opts.values():
            opt.step()
        diag.step({"encoder": loss, "decoder": loss})
        assert len(probe.calls_of(0, "encoder")) == 3
        assert len(probe.calls_of(0, "decoder")) == 6
