"""A GPT-style decoder for the GPU benchmark (nanoGPT's shape: pre-LayerNorm blocks, causal
``scaled_dot_product_attention``, 4x GELU MLP, tied embedding/head), trained under bf16 autocast.

``gpt``: 12 layers, d_model 768, 12 heads, vocab 32,768, seq 1,024, batch 8: ~111M parameters.
CUDA only (a CPU step would take seconds). ``gpt_tiny`` is the same code at 2 layers, d 64, seq 64:
the CPU smoke test runs it so the code path is exercised without a GPU (autocast is CUDA-only here,
so on CPU it trains in float32).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workloads import Workload


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied, as in GPT-2
        self.register_buffer("positions", torch.arange(seq), persistent=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02 / (2 * layers) ** 0.5 if name.endswith(("proj.weight", "out.weight")) else 0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(self.positions[: idx.shape[1]])
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))


def gpt_workload(name: str, vocab: int, d: int, layers: int, heads: int, seq: int, batch: int, cuda_only: bool) -> Workload:
    def batch_of(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens and a learnable target (a fixed permutation of the current token)."""
        x = torch.randint(0, vocab, (batch, seq), generator=g, device=g.device)
        return x, (x * 7 + 3) % vocab

    return Workload(name, lambda: GPT(vocab, d, layers, heads, seq), batch_of, _ce, amp=torch.bfloat16, cuda_only=cuda_only, lr=3e-4)


GPT_WORKLOADS = {
    "gpt": gpt_workload("gpt", vocab=32768, d=768, layers=12, heads=12, seq=1024, batch=8, cuda_only=True),
    "gpt_tiny": gpt_workload("gpt_tiny", vocab=512, d=64, layers=2, heads=4, seq=64, batch=4, cuda_only=False),
}
