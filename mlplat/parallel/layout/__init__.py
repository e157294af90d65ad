"""The layout of a run, as pure data (no torch): the parallel dimensions and their ranks (`dims`), the
vocabulary's padding (`vocab`), the pipeline's stages and chunks (`pipeline`), its schedules (`registry`, `orders`,
`zero_bubble`, `schedules`) and the plan of its transfers (`exchange`). The config validates against it, the cost
models and the simulator time it, and the runtime (the process groups, the pipeline engine) executes it."""
