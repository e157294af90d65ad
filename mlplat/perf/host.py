"""The cost of mlplat's work on a CPU box whose ranks are processes, from figures measured on it.

`experiments/calibrate/calibrate.py` measures the `cluster.cpu_*` figures (and gloo's latency and bandwidth, kept in
`cluster.nvlink_*`); `mlplat.perf.cpu_model` uses this module whenever they are set. Torch-free.

One thread runs a block (a transformer layer, the embedding, the head) in
    ops · op_us + GEMM FLOPs / gemm_gflops + element-wise bytes / memory_gbps
with the op counts below (aten ops of the real model code, checked by tests/perf/test_host.py) and FLOPs and bytes
counted from the shapes. Small models are dominated by the first term: a forward op costs a few µs whatever
its size. The three rates are fitted together on layers, embeddings and heads of several shapes.

Processes share cores, ours and other jobs' alike (Linux shares a core fairly between runnable processes):
with k of our ranks busy and `background` runnable processes of other jobs, the cores are crowded
c(k) = max(1, (k + background) / cores) times over. Compute was measured by one process, at c(1): a pass with k
ranks busy takes c(k) / c(1) times its measured time. A blocking message or collective costs its gloo work (α-β
measured back to back between 2 processes, at c(2); CPU-bound on loopback, so c(k) / c(2) times longer) plus a
wait per hand-off (the peer of a send, the next rank of a ring step must run to move the message along): on
cores that are not crowded the peer's core has gone idle and must be woken (`idle_wakeup_us`, large in a VM
whose idle vCPUs halt) while c(k) is near 1; on crowded ones it waits for a turn (`wakeup_us`, about one time
slice, however crowded). Between c(k) = 1 and 2 the one gives way to the other.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from mlplat.perf.flops import ModelDims

# aten ops per micro-batch of the real code (tp=1, kernels.fused=false, no recomputation): (forward, backward).
LAYER_OPS = (35, 72)  # the GPT layer; QKV viewed by key/value group (slice, select) since the Llama family came
EMBEDDING_OPS = (4, 5)
EMBEDDING_OPS_TP = (11, 6)  # t > 1: the vocabulary-range mask
HEAD_OPS = (28, 23)  # final LayerNorm, logits, vocab-parallel cross-entropy, mean
ALLREDUCE_OPS = 1  # the clone that keeps autograd's tensor intact (`mlplat.parallel.tensor._all_reduce`)


@dataclass(frozen=True)
class Work:
    """One pass of one block over one micro-batch."""

    flops: float  # GEMM FLOPs
    bytes: float  # element-wise memory traffic
    ops: float  # aten ops dispatched


@dataclass(frozen=True)
class Host:
    """The measured `cluster.cpu_*` figures."""

    cores: float
    background: float
    gemm_gflops: float
    memory_gbps: float
    op_us: float
    backward_op_us: float
    optimizer_us_per_tensor: float
    optimizer_ns_per_param: float
    idle_wakeup_us: float
    wakeup_us: float
    loop_us: float

    @classmethod
    def of(cls, c) -> "Host":
        """From a `ClusterConfig`'s `cpu_*` keys (`mlplat.config.CPU_KEYS`, the one list): each field is a key less
        its prefix."""
        from mlplat.config import CPU_KEYS

        return cls(**{key.removeprefix("cpu_"): getattr(c, key) for key in CPU_KEYS})

    def cluster_keys(self) -> dict[str, float]:
        """The `cluster.cpu_*` keys and values of these figures."""
        return {f"cpu_{f.name}": float(getattr(self, f.name)) for f in fields(self)}

    def seconds(self, w: Work, backward: bool = False) -> float:
        """One process as measured: alone among our ranks."""
        op = self.backward_op_us if backward else self.op_us
        return w.ops * op * 1e-6 + w.flops / (self.gemm_gflops * 1e9) + w.bytes / (self.memory_gbps * 1e9)

    def crowd(self, busy_ranks: float) -> float:
        """How many times over the cores are wanted while `busy_ranks` of ours compute."""
        return max(1.0, (busy_ranks + self.background) / self.cores)

    def sharing(self, busy_ranks: float) -> float:
        """How much slower a pass runs with `busy_ranks` busy than when it was measured (alone)."""
        return self.crowd(busy_ranks) / self.crowd(1)

    def message(self, seconds: float, handoffs: int, busy_ranks: float) -> float:
        """A blocking message or collective of `seconds` of gloo work (as measured back to back between 2 ranks)
        and `handoffs` hand-offs, while `busy_ranks` of ours are busy."""
        crowd = self.crowd(busy_ranks)
        # As the crowding grows from 1 to 2, idle cores get rarer and turns likelier; a turn is about one time
        # slice away however crowded the cores are.
        wait = self.idle_wakeup_us * min(1.0, max(0.0, 2.0 - crowd)) + self.wakeup_us * min(1.0, crowd - 1.0)
        return crowd / self.crowd(2) * seconds + handoffs * wait * 1e-6

    def optimizer_seconds(self, tensors: int, params: int) -> float:
        return tensors * self.optimizer_us_per_tensor * 1e-6 + params * self.optimizer_ns_per_param * 1e-9


def block_work(dims: ModelDims, micro_batch: int, tp: int, elem_bytes: int = 4, recompute: str = "none",
               sequence_parallel: bool = False, cp: int = 1) -> dict[str, tuple[Work, Work]]:
    """(forward, backward) work of one layer, the embedding and the head on one tensor-parallel rank. Sequence
    parallelism splits the LayerNorm, bias and residual passes along the sequence (its extra ops are not counted).
    Context parallelism (cp = c) leaves a rank s/c tokens, and 1/c of the attention core (its queries, all keys)."""
    s, h, t, ffn = dims.seq_len, dims.hidden, tp, dims.ffn
    M = micro_batch * s / cp  # tokens
    vocab = dims.padded_vocab(t) // t
    e = elem_bytes
    # QKV, output projection, the two MLP GEMMs (their weights: `layer_gemm_weights`, 12h² for the paper's GPT),
    # the attention core, QKᵀ and scores·V (its entry's `score_flops` per token and key; the CPU SDPA kernel does all
    # s² of them).
    core = 1.0 * micro_batch * s * s * dims.score_flops / t / cp
    dense = 2.0 * M * dims.layer_gemm_weights / t
    # Read + write passes: two LayerNorms, two bias adds, two residual adds (14·Mh); SDPA in/out and the
    # head-merging copy (6·Mh/t); the MLP's activation, its entry's `elementwise` (GeLU 2·M·ffn/t; SwiGLU 3·M·ffn/t:
    # gate and up in, the product out).
    replicated = t if sequence_parallel else 1
    act = float(dims.mlp_entry.elementwise)
    traffic = (14.0 * M * h / replicated + 6.0 * M * dims.attention_width / t + act * M * ffn / t) * e
    layer_f = Work(dense + core, traffic, LAYER_OPS[0])
    layer_b = Work(2 * (dense + core), 2 * traffic, LAYER_OPS[1])
    if recompute == "full":
        layer_b = Work(layer_b.flops + layer_f.flops, layer_b.bytes + layer_f.bytes, layer_b.ops + layer_f.ops)
    elif recompute == "selective":
        layer_b = Work(layer_b.flops + core, layer_b.bytes + 4.0 * M * h / t * e, layer_b.ops + 1)
    emb_ops = EMBEDDING_OPS if t == 1 else EMBEDDING_OPS_TP
    # Lookup + position add; backward: the dense gradient of this rank's vocabulary rows, and the positions'.
    emb_f = Work(0.0, 4.0 * M * h * e, emb_ops[0])
    emb_b = Work(0.0, (vocab * h + 3.0 * M * h) * e, emb_ops[1])
    # Final LayerNorm, logits GEMM, cross-entropy passes over the logits (max, shift, exp, sum, normalise).
    head_f = Work(2.0 * M * h * vocab, (2.0 * M * h + 6.0 * M * vocab) * e, HEAD_OPS[0])
    head_b = Work(4.0 * M * h * vocab, (4.0 * M * h + 4.0 * M * vocab + vocab * h) * e, HEAD_OPS[1])
    return {"layer": (layer_f, layer_b), "embedding": (emb_f, emb_b), "head": (head_f, head_b)}


def parameter_tensors(layers: int, first: bool, last: bool, tied_copy: bool, dims: ModelDims | None = None) -> int:
    """Parameter tensors of a rank holding `layers` layers (and the embedding / the head): each layer of the paper's
    GPT has 12 (two LayerNorms, QKV, output, fc1, fc2, weights and biases); `dims` counts another architecture's
    (a Llama layer: two RMSNorm weights and four GEMM weights, 6; the untied output layer one more on the last): the
    attention's as its entry counts them (`Attention.tensors`), the MLP's GEMMs with their biases."""
    if dims is None:
        return 12 * layers + (2 if first else 0) + (2 if last else 0) + (1 if tied_copy else 0)
    norm = 2 if dims.norm == "layernorm" and dims.bias else 1
    mlp = sum(1 + g.has_bias(dims) for g in dims.mlp_entry.gemms)
    per_layer = 2 * norm + dims.attention_entry.tensors(dims) + mlp
    embedding = 1 + (1 if dims.position == "learned" else 0)
    head = norm + (0 if dims.tie_embeddings else 1) + dims.mtp.depth * (per_layer + 3 * norm + 1)  # MTP: + proj
    return per_layer * layers + (embedding if first else 0) + (head if last else 0) + (1 if tied_copy else 0)


def mean_concurrency(spans: list[tuple[int, float, float]]) -> list[float]:
    """For each span (rank, start, end): how many ranks' spans (its own included) cover it, on average over it."""
    edges = sorted({x for _, a, b in spans for x in (a, b)})
    if not edges:
        return []
    index = {x: i for i, x in enumerate(edges)}
    delta = [0] * (len(edges) + 1)
    for _, a, b in spans:
        delta[index[a]] += 1
        delta[index[b]] -= 1
    integral = [0.0] * len(edges)  # ∫ (spans covering τ) dτ from the first edge
    active = 0
    for i in range(1, len(edges)):
        active += delta[i - 1]
        integral[i] = integral[i - 1] + active * (edges[i] - edges[i - 1])
    return [(integral[index[b]] - integral[index[a]]) / (b - a) if b > a else 1.0 for _, a, b in spans]


def fit_relative(rows: list[tuple[list[float], float]]) -> list[float]:
    """Non-negative least squares on relative error of y ≈ Σ x_i · c_i over rows (x, y): a coefficient that comes
    out negative is dropped (set to 0) and the rest refitted. How the figures above are fitted to timings."""
    import numpy as np  # lazily: the planner needs none of this

    a = np.array([r[0] for r in rows], dtype=float)
    y = np.array([r[1] for r in rows], dtype=float)
    a, y = a / y[:, None], np.ones_like(y)
    keep = list(range(a.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(a[:, keep], y, rcond=None)
        if (coef > 0).all() or len(keep) == 1:
            out = [0.0] * a.shape[1]
            for k, c in zip(keep, coef):
                out[k] = max(float(c), 0.0)
            return out
        keep.pop(int(np.argmin(coef)))


def alpha_beta(times: dict[int, float], handoffs: int) -> tuple[float, float]:
    """(seconds per hand-off, bytes/s) of a message or collective: a line through (bytes, seconds), fitted on
    relative error."""
    alpha, per_byte = fit_relative([([handoffs, n], sec) for n, sec in times.items()])
    return alpha, 1 / per_byte if per_byte > 0 else 1e12
