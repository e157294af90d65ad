"""The paper's Table 1 (Narayanan et al., SC21) and its cluster, shared by the cost-model and planner tests."""
from __future__ import annotations

from mlplat.perf.cluster import Cluster

TABLE1 = ["gpt1p7b", "gpt3p6b", "gpt7p5b", "gpt18b", "gpt39b", "gpt76b", "gpt145b", "gpt310b", "gpt530b", "gpt1t"]
PAPER_PARAMS_B = [1.7, 3.6, 7.5, 18.4, 39.1, 76.1, 145.6, 310.1, 529.6, 1008.0]
PAPER_TFLOPS = [137, 138, 142, 135, 138, 140, 148, 155, 163, 163]


def a100() -> Cluster:
    from mlplat.plan import load_group

    return Cluster.from_config(load_group("cluster", "dgx_a100"))
