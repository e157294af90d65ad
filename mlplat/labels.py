"""The label convention the data and the loss share, owned by neither: a label of IGNORE adds nothing to the loss or
to the count of tokens it is averaged over (torch's cross-entropy `ignore_index` default). Packed documents set it on
the position whose target is the next document's first token (`mlplat.data.packing`); the vocabulary-parallel loss
and the token layout read it (`mlplat.parallel.cross_entropy`, `mlplat.parallel.placement`)."""

IGNORE = -100
