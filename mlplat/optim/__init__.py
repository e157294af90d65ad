"""The optimizer and what it steps: the flat buffers of weights, gradients, main weights and Adam's moments per bucket
with their reductions over the replicas (`buffers`), AdamW on the main weights (`main_params`) and fp16's dynamic
loss scaling (`loss_scale`). Built on mlplat.parallel's grid and collectives; no Lightning, no Hydra."""
