"""Packed documents, in one process and float64: a packed window's loss is the documents' own losses computed one by
one, and the tokens of one document do not touch (bit for bit) the logits of any other, for both architectures
and every CPU attention backend. The same checks under context parallelism run in tests/parallel/test_context.py;
the CLI runs (data.pack=true) in tests/cli/test_train.py."""
from __future__ import annotations

import pytest
import torch

from mlplat.config import KernelsConfig, ModelConfig
from mlplat.data.packing import PackedWindows, documents_of
from mlplat.labels import IGNORE
from mlplat.model.decoder import DecoderChunk
from mlplat.model.init import init_full_view
from mlplat.parallel.grid import ParallelGrid
from mlplat.parallel.placement import place
from mlplat.parallel.random import RNGTracker, seed_model_parallel

EOD = 0
S = 48
ARCHS = {
    "gpt": ModelConfig(n_layers=2, hidden=32, n_heads=4, seq_len=S, vocab_size=64),
    "llama": ModelConfig(arch="llama", n_layers=2, hidden=32, n_heads=4, n_kv_heads=2, seq_len=S, vocab_size=64,
                         ffn_hidden=64),
}


def packed_window(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) [1, S] of documents of uneven lengths back to back, each ended by EOD; the window starts
    inside a document and ends inside another, as cut windows do."""
    g = torch.Generator().manual_seed(seed)
    stream = []
    for length in (7, 3, 12, 1, 9, 15, 11):
        stream += [int(t) for t in torch.randint(1, 64, (length,), generator=g)] + [EOD]
    window = torch.tensor(stream[2: S + 3])
    x, y = window[:-1][None], window[1:][None]
    return x, y.masked_fill(x == EOD, IGNORE)


def chunk_for(arch: str, backend: str = "math") -> DecoderChunk:
    return chunk_on(ParallelGrid(), arch, backend)


def chunk_on(grid: ParallelGrid, arch: str, backend: str) -> DecoderChunk:
    """The whole model as one chunk on `grid` (context-parallel ranks hold it whole), float64, the same weights on
    every grid."""
    tracker = RNGTracker()
    seed_model_parallel(0, grid, tracker)
    chunk = DecoderChunk(ARCHS[arch], grid, 0, 1, kernels=KernelsConfig(attention=backend), tracker=tracker,
                     backend=backend, dtype=torch.float64)
    init_full_view(chunk, seed=3)
    return chunk.eval()


def document_spans(x: torch.Tensor) -> list[tuple[int, int]]:
    documents = documents_of(x[0], EOD)
    return [(int(idx[0]), int(idx[-1]) + 1) for d in documents.unique()
            for idx in [torch.nonzero(documents == d).flatten()]]


def documents_own_loss(chunk: DecoderChunk, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The window's documents run one by one, each as a sequence of its own (its tokens up to its last counted
    label): the sum of their token losses over the number of counted labels."""
    total, counted = torch.zeros((), dtype=torch.float64), 0
    for a, b in document_spans(x):
        keep = (y[0, a:b] != IGNORE).nonzero().flatten()
        if keep.numel() == 0:
            continue
        end = a + int(keep[-1]) + 1
        with torch.no_grad():
            total = total + chunk(x[:, a:end], y[:, a:end]) * (end - a)
        counted += int(keep.numel())
    assert counted == int((y != IGNORE).sum())
    return total / counted


def changed_document(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
    """x with the tokens of a whole document in the middle of the window changed (never into EOD; its EOD kept),
    and that document's span."""
    a, b = document_spans(x)[2]
    changed = x.clone()
    changed[0, a:b - 1] = (changed[0, a:b - 1] * 7 + 5) % 63 + 1
    assert not torch.equal(changed, x)
    return changed, (a, b)


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("backend", ["math", "sdpa"])
def test_packed_loss_is_the_documents_own_losses(arch, backend):
    chunk = chunk_for(arch, backend)
    x, y = packed_window()
    xs, ys, layout = place(x, y, S, documents=documents_of(x, EOD))
    with torch.no_grad():
        packed = chunk(xs, ys, layout)
    assert len(document_spans(x)) >= 6 and layout.loss_tokens == int((y != IGNORE).sum())
    assert abs(float(packed) - float(documents_own_loss(chunk, x, y))) < 1e-12


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("backend", ["math", "sdpa"])
def test_a_document_does_not_touch_the_others_logits(arch, backend):
    chunk = chunk_for(arch, backend)
    x, y = packed_window()
    changed, (a, b) = changed_document(x)

    def logits(tokens):
        xs, _, layout = place(tokens, y, S, documents=documents_of(tokens, EOD))
        with torch.no_grad():
            return chunk(xs, None, layout)

    before, after = logits(x), logits(changed)
    outside = torch.ones(S, dtype=torch.bool)
    outside[a:b] = False
    assert torch.equal(before[:, outside], after[:, outside])
    assert not torch.equal(before[:, a:b], after[:, a:b])


def test_packed_windows_mask_the_eod_label_and_number_documents():
    class Windows:
        def __len__(self):
            return 1

        def __getitem__(self, i):
            return torch.tensor([5, 6, EOD, 7, EOD, EOD, 8]), torch.tensor([6, EOD, 7, EOD, EOD, 8, 9])

    x, y, documents = PackedWindows(Windows(), EOD)[0]
    assert documents.tolist() == [0, 0, 0, 1, 1, 2, 3]
    assert y.tolist() == [6, EOD, IGNORE, EOD, IGNORE, IGNORE, 9]
