"""Where a micro-batch's tokens sit: context parallelism's load-balanced split, packed documents' positions and
masks, and the labels that do not count.

Each of the c ranks of a cp group holds 1/c of every sequence. The causal load balance: the window of s tokens is
cut into 2c chunks and cp rank i holds chunks i and 2c-1-i, so every rank holds as many early tokens (few keys to
attend to) as late ones (many). `place` gives a rank its tokens, labels and their `TokenLayout`, which the layers
read (positions, the attention mask, the loss's divisor). Pure tensor arithmetic, no process groups: the data
pipeline uses it too. Ring attention over the split is `mlplat.parallel.context`.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from mlplat.labels import IGNORE


def chunk_bounds(seq_len: int, cp: int, cp_rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The two [start, end) ranges of the window cp rank `cp_rank` holds: chunks cp_rank and 2c-1-cp_rank."""
    size = seq_len // (2 * cp)
    late = 2 * cp - 1 - cp_rank
    return (cp_rank * size, (cp_rank + 1) * size), (late * size, (late + 1) * size)


def local_index(seq_len: int, cp: int, cp_rank: int, device=None) -> torch.Tensor:
    """The places in the window of the tokens cp rank `cp_rank` holds, ascending ([s/c] long)."""
    if cp == 1:
        return torch.arange(seq_len, device=device)
    (a, b), (x, y) = chunk_bounds(seq_len, cp, cp_rank)
    return torch.cat((torch.arange(a, b, device=device), torch.arange(x, y, device=device)))


@functools.lru_cache(maxsize=1024)
def visible_part(seq_len: int, cp: int, cp_rank: int, owner: int) -> tuple[int, int, bool]:
    """What of owner's K/V block the causal mask leaves cp rank `cp_rank`'s queries: (first query row, number of key
    columns, whether every query of that part sees every key of it). The local places are ascending, so the
    queries that see one of its keys are a suffix and the keys seen a prefix. From the split alone, on the host,
    once per (window, ranks): every layer and micro-batch asks the same."""
    q_index = local_index(seq_len, cp, cp_rank)
    k_index = local_index(seq_len, cp, owner)
    row = int(torch.searchsorted(q_index, k_index[0]))
    cols = int(torch.searchsorted(k_index, q_index[-1], right=True))
    whole = row < len(q_index) and cols > 0 and bool(q_index[row] >= k_index[cols - 1])
    return row, cols, whole


@dataclass(frozen=True)
class TokenLayout:
    """What the layers need to know of the tokens this rank holds of one micro-batch (None for an unpacked window
    held whole: the plain causal path).

    index: [s_local] their places in the window (ascending). positions: [b, s_local] their position ids (restarting
    at each document when packed). documents: [b, s] the document of every token of the whole window, or None (one
    document). loss_tokens: how many labels of the micro-batch count, over all cp ranks (the loss's divisor; a
    tensor on the batch's device, so that the host never waits for it). labels: [b, s] the whole window's labels
    under context parallelism (None otherwise, or where the stage reads none): the multi-token prediction's targets
    k tokens ahead lie in other ranks' chunks (`mlplat.model.mtp`).
    """

    seq_len: int
    cp: int
    cp_rank: int
    index: torch.Tensor
    positions: torch.Tensor
    documents: torch.Tensor | None
    loss_tokens: torch.Tensor
    labels: torch.Tensor | None = None

    def index_of(self, cp_rank: int) -> torch.Tensor:
        return self.index if cp_rank == self.cp_rank else local_index(self.seq_len, self.cp, cp_rank,
                                                                        self.index.device)

    def visible(self, owner: int) -> tuple[int, int, bool]:
        """(first query row, number of key columns, whether every query sees every key) of the part of owner's
        block the causal mask leaves any of (`visible_part`)."""
        return visible_part(self.seq_len, self.cp, self.cp_rank, owner)

    @functools.cached_property
    def boundaries(self) -> tuple[torch.Tensor, int]:
        """flash-attn's varlen description of the packed micro-batch flattened to [b·s]: (cu_seqlens int32, the
        first token of each document and the total at the end; the longest document's length). Computed once per
        micro-batch (it reads the device), for every layer."""
        b, s = self.documents.shape
        flat = (self.documents + torch.arange(b, device=self.documents.device)[:, None] * (s + 1)).reshape(-1)
        starts = torch.nonzero(torch.cat((flat.new_ones(1, dtype=torch.bool), flat[1:] != flat[:-1]))).flatten()
        cu = torch.cat((starts, starts.new_tensor([b * s]))).to(torch.int32)
        return cu, int((cu[1:] - cu[:-1]).max())

    def mask(self, q_index: torch.Tensor, k_index: torch.Tensor) -> torch.Tensor:
        """[b or 1, 1, len(q_index), len(k_index)] True where a query attends to a key: causal, same document."""
        keep = (q_index[:, None] >= k_index[None, :])[None, None]
        if self.documents is not None:
            dq, dk = self.documents[:, q_index], self.documents[:, k_index]
            keep = keep & (dq[:, None, :, None] == dk[:, None, None, :])
        return keep


def positions_of(documents: torch.Tensor) -> torch.Tensor:
    """[b, s] position ids restarting at 0 at each document's first token (Megatron's reset_position_ids)."""
    s = documents.size(1)
    index = torch.arange(s, device=documents.device).expand_as(documents)
    first = torch.ones_like(documents, dtype=torch.bool)
    first[:, 1:] = documents[:, 1:] != documents[:, :-1]
    start = torch.where(first, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - start


def place(tokens: torch.Tensor, labels: torch.Tensor, seq_len: int, cp: int = 1, cp_rank: int = 0,
          documents: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, TokenLayout | None]:
    """This rank's share of a micro-batch of windows of seq_len tokens: (its token ids, its labels, their layout).
    The plain case (one rank, no documents) gives the micro-batch as it is and no layout. Empty tokens or labels
    (a pipeline stage that does not read them) stay empty."""
    if cp == 1 and documents is None:
        return tokens, labels, None
    s = seq_len
    device = (documents if documents is not None else tokens).device
    index = local_index(s, cp, cp_rank, device)
    positions = positions_of(documents)[:, index] if documents is not None else index[None]
    counted = (labels != IGNORE).sum() if labels.numel() else torch.zeros((), dtype=torch.long, device=device)
    layout = TokenLayout(s, cp, cp_rank, index, positions, documents, counted,
                         labels if cp > 1 and labels.numel() else None)

    def mine(x):
        return x[:, index] if x.size(-1) else x
    return mine(tokens), mine(labels), layout
