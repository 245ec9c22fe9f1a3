"""A tiny causal transformer (random weights, no downloads) that exposes its KV cache, for tests."""

from __future__ import annotations

import torch
from torch import nn

VOCAB, DIM, HEADS, LAYERS = 512, 64, 4, 2
HEAD_DIM = DIM // HEADS


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
        self.n1, self.n2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)

    def forward(self, x: torch.Tensor, past: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, DIM]; past: [2, P, HEADS, HEAD_DIM] or None; returns (x, this layer's KV [2, P+T, H, D])."""
        t = x.shape[0]
        q, k, v = self.qkv(self.n1(x)).view(t, 3, HEADS, HEAD_DIM).unbind(1)
        kv = torch.stack([k, v])
        if past is not None:
            kv = torch.cat([past, kv], dim=1)
        p = kv.shape[1] - t
        att = torch.einsum("thd,shd->hts", q, kv[0]) / HEAD_DIM**0.5
        mask = torch.ones(t, p + t, dtype=torch.bool).tril(diagonal=p)
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        y = torch.einsum("hts,shd->thd", att, kv[1]).reshape(t, DIM)
        x = x + self.out(y)
        return x + self.mlp(self.n2(x)), kv


class Tiny(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.eval()

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, past: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states of `tokens` after `past` ([LAYERS, 2, P, H, D]), and the KV of all P+T tokens."""
        x = self.emb(tokens)
        kvs = []
        for i, layer in enumerate(self.layers):
            x, kv = layer(x, None if past is None else past[i])
            kvs.append(kv)
        return x, torch.stack(kvs)
