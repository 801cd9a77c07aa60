"""Realistic models and data in the styles users write, for the gradient-truth, wrapped-optimizer
and fault-zoo tests: a word-level LSTM language model (PyTorch's word_language_model example:
hidden state carried between batches, hand-written SGD), a character-level GPT (nanoGPT-style:
causal self-attention blocks, AdamW, warm-up, clipping, accumulation), a CNN with BatchNorm and
dropout on real images (scikit-learn's digits), and a names-generator-style sequence model whose
targets are padded with an ignore index.

The text corpus is a frozen snapshot of this repository's README and library source (real English
prose and Python, 810 kB; ``tests/data/corpus.txt.gz``): no download, and the same data whatever the
code of the day says (a corpus read from the live sources changed every run's trajectory).
"""
from __future__ import annotations

import functools
import gzip
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]


@functools.lru_cache(maxsize=None)
def corpus() -> str:
    return gzip.decompress((ROOT / "tests" / "data" / "corpus.txt.gz").read_bytes()).decode("utf-8")


@functools.lru_cache(maxsize=None)
def char_data() -> tuple[torch.Tensor, int]:
    """The corpus as character ids (vocabulary: its distinct characters)."""
    text = corpus()
    chars = sorted(set(text))
    idx = {c: i for i, c in enumerate(chars)}
    return torch.tensor([idx[c] for c in text], dtype=torch.long), len(chars)


@functools.lru_cache(maxsize=None)
def word_data(max_vocab: int = 2000) -> tuple[torch.Tensor, int]:
    """The corpus as word ids, rare words mapped to ``<unk>`` (id 0)."""
    words = corpus().replace("\n", " <eos> ").split()
    counts: dict[str, int] = {}
    for w in words:
        counts[w] = counts.get(w, 0) + 1
    vocab = ["<unk>"] + sorted(counts, key=lambda w: -counts[w])[: max_vocab - 1]
    idx = {w: i for i, w in enumerate(vocab)}
    return torch.tensor([idx.get(w, 0) for w in words], dtype=torch.long), len(vocab)


def batchify(data: torch.Tensor, bsz: int) -> torch.Tensor:
    """word_language_model's layout: (len, bsz) columns of the stream."""
    n = data.size(0) // bsz
    return data[: n * bsz].view(bsz, -1).t().contiguous()


def lm_batches(source: torch.Tensor, bptt: int):
    """Endless (input, target) windows over a batchified stream."""
    while True:
        for i in range(0, source.size(0) - 1 - bptt, bptt):
            yield source[i : i + bptt], source[i + 1 : i + 1 + bptt]


def char_batches(data: torch.Tensor, block: int, bsz: int, seed: int = 0):
    """nanoGPT's get_batch: random windows of ``block`` characters."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        ix = torch.randint(len(data) - block - 1, (bsz,), generator=gen)
        x = torch.stack([data[i : i + block] for i in ix])
        y = torch.stack([data[i + 1 : i + 1 + block] for i in ix])
        yield x, y


# ----------------------------------------------------------------------------- models
class WordLM(nn.Module):
    """Embedding -> LSTM -> decoder, tied weights, dropout: word_language_model's RNNModel."""

    def __init__(self, ntoken: int, ninp: int = 32, nhid: int = 32, nlayers: int = 2, dropout: float = 0.2) -> None:
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        self.decoder.weight = self.encoder.weight  # tied, as --tied
        self.nlayers, self.nhid = nlayers, nhid
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)

    def forward(self, input: torch.Tensor, hidden: tuple[torch.Tensor, torch.Tensor]):  # noqa: A002
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        return self.decoder(self.drop(output)), hidden

    def init_hidden(self, bsz: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = next(self.parameters())
        return w.new_zeros(self.nlayers, bsz, self.nhid), w.new_zeros(self.nlayers, bsz, self.nhid)


def repackage(h):
    return tuple(v.detach() for v in h) if isinstance(h, tuple) else h.detach()


class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, heads: int, block: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.heads = heads
        self.register_buffer("bias", torch.tril(torch.ones(block, block)).view(1, 1, block, block))
        # a fault switch the tests can flip without a recompile: 1.0 makes the output log1p(-1) = -inf
        self.register_buffer("fault", torch.zeros(()), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf")).softmax(dim=-1)
        return self.c_proj((att @ v).transpose(1, 2).contiguous().view(b, t, c)) + torch.log1p(-self.fault)


class Block(nn.Module):
    def __init__(self, d: int, heads: int, block: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads, block)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class CharGPT(nn.Module):
    """nanoGPT's GPT, tiny: ``forward(idx, targets)`` returns ``(logits, loss)``."""

    def __init__(self, vocab: int, block: int = 32, d: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.h = nn.ModuleList([Block(d, heads, block) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.wte.weight = self.lm_head.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for blk in self.h:
            x = blk(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


def gpt_optimizer(model: nn.Module, lr: float, weight_decay: float = 0.1) -> torch.optim.AdamW:
    """nanoGPT's configure_optimizers: decay for matrices, none for biases and norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95))


def warmup_cosine(it: int, lr: float, warmup: int, total: int) -> float:
    """nanoGPT's get_lr."""
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    ratio = min(1.0, (it - warmup) / max(1, total - warmup))
    return 0.1 * lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * 0.9 * lr


class DigitsCNN(nn.Module):
    """conv-BN-ReLU x2, dropout, linear head: 8x8 digit images."""

    def __init__(self, p_drop: float = 0.25) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2))
        self.drop = nn.Dropout(p_drop)
        self.head = nn.Linear(32 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.features(x.view(-1, 1, 8, 8)).flatten(1)))


@functools.lru_cache(maxsize=None)
def names_data() -> tuple[list[list[int]], int]:
    """Words of the corpus as character sequences (a names-generator's data): 1..V ids, 0 = start."""
    words = sorted({w.strip(".,;:()`*[]\"'").lower() for w in corpus().split()})
    words = [w for w in words if w.isalpha() and 3 <= len(w) <= 12]
    chars = sorted(set("".join(words)))
    idx = {c: i + 1 for i, c in enumerate(chars)}
    return [[idx[c] for c in w] for w in words], len(chars) + 1


def names_batches(bsz: int, pad: int = -1, seed: int = 0):
    """(input, target) pairs, input = [0, c1..cn], target = [c1..cn, end=0], padded with ``pad``."""
    seqs, _ = names_data()
    gen = torch.Generator().manual_seed(seed)
    while True:
        pick = torch.randint(len(seqs), (bsz,), generator=gen).tolist()
        width = max(len(seqs[i]) for i in pick) + 1
        x = torch.zeros(bsz, width, dtype=torch.long)
        y = torch.full((bsz, width), pad, dtype=torch.long)
        for row, i in enumerate(pick):
            s = seqs[i]
            x[row, 1 : len(s) + 1] = torch.tensor(s)
            y[row, : len(s)] = torch.tensor(s)
            y[row, len(s)] = 0
        yield x, y


class NamesModel(nn.Module):
    """Embedding -> GRU -> head, next character of a name."""

    def __init__(self, vocab: int, d: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.gru = nn.GRU(d, d, batch_first=True)
        self.head = nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(self.emb(x))
        return self.head(out)


def digits_split() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from _zoo_a import digits

    return digits()


def ref_norm(params, dtype=torch.float64) -> float:
    """The global L2 norm of the parameters' gradients, by hand in float64."""
    total = 0.0
    for p in params:
        g = p.grad
        if g is None:
            continue
        g = g.coalesce().values() if g.is_sparse else g
        g = g.to(torch.complex128) if g.is_complex() else g.to(dtype)
        total += float(g.abs().pow(2).sum())
    return math.sqrt(total)
