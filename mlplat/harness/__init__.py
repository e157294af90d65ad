"""Harnesses around the parallel code, for tests, experiments and verification runs: `launch` runs a function on N
local CPU processes joined by a gloo group; `nccl_strict` makes gloo block where NCCL's host does
(MLPLAT_NCCL_STRICT=1). Neither is part of a training step."""
