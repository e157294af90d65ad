"""Token windows for next-token prediction, and the train/validation split."""
from __future__ import annotations

import torch
from torch.utils.data import Dataset


class TokenWindows(Dataset):
    """Non-overlapping windows of seq_len+1 tokens: inputs are the first seq_len, labels the last seq_len."""

    def __init__(self, tokens: torch.Tensor, seq_len: int):
        if tokens.numel() < seq_len + 1:
            raise ValueError(f"the text has {tokens.numel()} tokens, fewer than model.seq_len+1={seq_len + 1}")
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (self.tokens.numel() - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.tokens[i * self.seq_len: (i + 1) * self.seq_len + 1]
        return window[:-1], window[1:]


def split_tokens(tokens: torch.Tensor, val_fraction: float, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The last val_fraction of the stream is validation (at least one window), the rest training."""
    n_val = max(int(tokens.numel() * val_fraction), seq_len + 1)
    return tokens[:-n_val], tokens[-n_val:]


class StageView(Dataset):
    """What one pipeline stage needs of each window: token ids on the first stage, labels on the last, nothing
    in between (empty tensors keep every rank's loader the same length, as Lightning's loop requires). Packed
    windows' documents go to every stage: every layer's attention masks by them."""

    _EMPTY = torch.empty(0, dtype=torch.long)

    def __init__(self, windows, tokens: bool, labels: bool, packed: bool = False):
        self.windows, self.tokens, self.labels, self.packed = windows, tokens, labels, packed

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        if not (self.tokens or self.labels or self.packed):
            return self._EMPTY, self._EMPTY
        x, y, *documents = self.windows[i]
        return (x if self.tokens else self._EMPTY), (y if self.labels else self._EMPTY), *documents
