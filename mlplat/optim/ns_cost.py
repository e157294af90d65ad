"""The Newton–Schulz iteration's FLOPs, torch-free: what Muon's whole matrices are dealt to the shards by
(`mlplat.optim.muon.step_work`) and what the cost models charge for its step (`mlplat.perf.muon`), one count."""
from __future__ import annotations


def ns_flops(rows: int, cols: int, steps: int) -> float:
    """FLOPs of `steps` Newton–Schulz iterations on a rows×cols matrix (`mlplat.optim.muon.newton_schulz`): per
    iteration X·Xᵀ (2·A²·B), its square (2·A³) and the product with X (2·A²·B), A ≤ B."""
    a, b = sorted((rows, cols))
    return steps * (4.0 * a * a * b + 2.0 * a ** 3)
