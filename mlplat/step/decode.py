"""Text generation from a training step's model (`generate`): the model's decoding (`mlplat.model.generation`) on the
step's engine, at a settled step, without dropout. Every rank takes part and returns the same tokens."""
from __future__ import annotations

from mlplat.model import generation
from mlplat.model.builder import eval_mode, weights_fixed
from mlplat.step.train_step import TrainStep


def generate(step: TrainStep, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0) -> list[int]:
    """The prompt followed by `max_new_tokens` tokens, greedy at temperature 0, else drawn (seeded by `seed`)."""
    engine = step.engine
    step.settle()  # generation reads the weights: a step taken before its checks stands or is redone first
    with eval_mode(step.chunks.values()), weights_fixed(step.chunks.values()):
        return generation.generate(engine, step.cfg.model, prompt_ids, max_new_tokens, temperature, top_k, top_p,
                                   seed, device=step.parameters()[0].device,
                                   every_replica=step.cfg.optim.sharding == "params")
