"""Packed documents: a window's documents told apart, so that nothing crosses from one into the next.

The token stream holds the documents back to back, each ended by the tokenizer's end-of-document token, and
windows are cut from it as usual. For each window this gives every token its document (the number of
end-of-document tokens before it: the token itself belongs to the document it ends) and masks the label of each
end-of-document position: what follows it is the next document's first token, which nothing in the window may
predict. The model then restarts positions at each document and keeps attention inside it
(`mlplat.parallel.placement.TokenLayout`). These are Megatron's reset_position_ids, reset_attention_mask and
eod_mask_loss. A window's first document may be the tail of one that began in the previous window; it is trained
on as a document of its own, from position 0, as in Megatron.
"""
from __future__ import annotations

import torch
from torch.utils.data import Dataset

from mlplat.labels import IGNORE


def documents_of(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """The document of every token of a window ([..., s] long): 0 up to and including the first end-of-document
    token, then 1, and so on."""
    ends = (tokens == eod).long()
    return ends.cumsum(-1) - ends


class PackedWindows(Dataset):
    """(inputs, labels, documents) for each window of `windows` (any dataset of (inputs, labels) pairs): the labels
    of end-of-document inputs are IGNORE."""

    def __init__(self, windows, eod: int):
        self.windows, self.eod = windows, eod

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, y = self.windows[i]
        return x, y.masked_fill(x == self.eod, IGNORE), documents_of(x, self.eod)
