"""The optimizer and what it steps: the optimizers a run can name (`factory`, optim.name), the flat buffers of
weights, gradients, main weights and the optimizer's state per bucket with their reductions over the replicas
(`buffers`), AdamW on the main weights (`main_params`) and fp16's dynamic loss scaling (`loss_scale`). Built on
mlplat.parallel's grid and collectives; no Lightning, no Hydra."""
