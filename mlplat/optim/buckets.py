"""The gradient buckets' size, torch-free so that the cost models read the engine's own figure."""

BUCKET_BYTES = 4 * 2**20  # reduced as each fills in backward; small enough to start early, large enough per launch
