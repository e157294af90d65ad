"""Generation's next-token choice: greedy, top-k, top-p, seeded."""
from __future__ import annotations

import torch

from mlplat.model.sampling import filter_logits, sample_next


def test_sampling_greedy_top_k_top_p_and_seeded():
    logits = torch.tensor([1.0, 3.0, 2.0, 0.5, 2.9])
    assert sample_next(logits, temperature=0.0) == 1
    kept = torch.isfinite(filter_logits(logits, top_k=2))
    assert kept.tolist() == [False, True, False, False, True]
    probs = torch.softmax(logits, -1)  # sorted: 1 (.39), 4 (.35), 2 (.14), ...
    kept = torch.isfinite(filter_logits(logits, top_p=0.5)).tolist()
    assert kept == [False, True, False, False, True] and probs[1] < 0.5
    assert torch.isfinite(filter_logits(logits, top_p=0.01)).tolist() == [False, True, False, False, False]
    draws = [sample_next(logits, 1.0, 2, 1.0, torch.Generator().manual_seed(s)) for s in range(50)]
    assert set(draws) == {1, 4}
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert [sample_next(logits, 0.8, 0, 0.9, g1) for _ in range(20)] == \
        [sample_next(logits, 0.8, 0, 0.9, g2) for _ in range(20)]
