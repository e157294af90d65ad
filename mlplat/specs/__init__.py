"""The registered parts, as pure data: what the config, the cost models and the runtime all read of a part, declared
once per part, without torch (each entry names its runtime, imported where a model is built). The pipeline schedules'
registry (`mlplat.parallel.layout.registry`) is the first of the kind."""
