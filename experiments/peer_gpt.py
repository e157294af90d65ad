"""The peer for benchmarks: the same GPT written the obvious way in plain PyTorch (nn.Linear, SDPA, tied
embeddings, no mlplat code), so a benchmark can time mlplat against it in the same run."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class PeerBlock(nn.Module):
    def __init__(self, h: int, heads: int, dropout: float = 0.0):
        super().__init__()
        self.heads, self.p = heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0, is_causal=True)
        x = x + F.dropout(self.proj(a.transpose(1, 2).reshape(b, s, h)), self.p, self.training)
        return x + F.dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))), self.p, self.training)


class PeerGPT(nn.Module):
    """Pre-LN GPT with learned positions and a tied output embedding over a vocabulary padded to 128."""

    def __init__(self, n_layers: int, hidden: int, n_heads: int, seq_len: int, vocab_size: int,
                 dropout: float = 0.0, init_std: float = 0.02, **_: object):
        super().__init__()
        self.vocab, self.p = vocab_size, dropout
        padded = -(-vocab_size // 128) * 128
        self.wte, self.wpe = nn.Embedding(padded, hidden), nn.Embedding(seq_len, hidden)
        self.blocks = nn.ModuleList(PeerBlock(hidden, n_heads, dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(hidden)
        for name, param in self.named_parameters():
            if param.dim() > 1:
                nn.init.normal_(param, 0.0, init_std)
            elif name.endswith("bias"):
                nn.init.zeros_(param)

    def forward(self, ids, labels):
        x = self.wte(ids) + self.wpe(torch.arange(ids.size(1), device=ids.device))
        x = F.dropout(x, self.p, self.training)
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)[..., : self.vocab]
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1))
