"""The run configuration's schema: the typed sections users set (`model.*`, `parallel.*`, ...), their allowed
values, and the conversion of a Hydra config (or a plain mapping) into them, with each key's type checked
(`from_raw`, `from_dict`). The rules between values are `mlplat.config.rules`."""
from __future__ import annotations

import math
import os
from dataclasses import MISSING, asdict, dataclass, field, fields, is_dataclass
from typing import Any, Mapping

from mlplat.errors import ConfigError
from mlplat.optim.factory import DEFAULT as DEFAULT_OPTIMIZER  # the registry is torch-free
from mlplat.parallel.layout.dims import ParallelDims  # pure data, no torch
from mlplat.parallel.layout.pipeline import PipelineLayout  # pure data, no torch
from mlplat.parallel.layout.registry import DEFAULT as DEFAULT_SCHEDULE
from mlplat.parallel.layout.vocab import pad_vocab_size  # pure arithmetic
from mlplat.specs import attentions, mlps

ATTENTION_BACKENDS = ("auto", "flash", "sdpa", "math")  # kernels.attention (mlplat.model.attention runs them)
# Ring attention's block kernels (parallel.cp > 1) and the devices each runs on: it merges K/V blocks by their
# log-sum-exp, which `math` computes anywhere and `sdpa` takes from PyTorch's CPU flash kernel.
RING_KERNELS = {"math": ("cpu", "cuda"), "sdpa": ("cpu", "cuda")}
RECOMPUTE = ("none", "selective", "full")
# kernels.fp8 (mlplat.parallel.fp8): the transformer layers' GEMMs in FP8 under current scaling, or none.
from mlplat.precision import TABLE as _PRECISION_TABLE  # noqa: E402  (torch-free: what each precision means)

PRECISIONS = tuple(_PRECISION_TABLE)
# Megatron-style mixed precision (mlplat.optim.main_params): bf16/fp16 weights, fp32 main weights and gradients.
MEGATRON_PRECISIONS = tuple(name for name, entry in _PRECISION_TABLE.items() if entry.megatron)
GRAD_REDUCE_DTYPES = ("main", "bf16")
# optim.sharding: what each data-parallel rank holds 1/d of (docs/parallelism.md)
SHARDINGS = ("none", "optim", "params")
LOGGERS = ("wandb", "csv", "none")
WANDB_PROJECT_FORBIDDEN = ("/", "\\", "#", "?", "%", ":")
ACCELERATORS = ("cpu", "gpu", "cuda", "auto")
WANDB_MODES = ("online", "offline")  # what mlplat.train.make_logger gives W&B (null: online with a key, else offline)
MIN_TEMPERATURE = 1e-3  # sample.temperature: 0 (greedy) or at least this
ACTIVATIONS = ("gelu", "gelu_tanh")  # exact (erf) GeLU; GPT-2's tanh approximation
DATA_NAMES = ("pydoc", "text", "indexed")

# Every key a user can type is a field below, with its one-line meaning next to it; `conf/` sets values, and
# tests/test_config.py fails when a key exists in one and not the other.

# model.arch's defaults for the keys left null: the 2019 GPT-2 block, or the Llama family's.
ARCHS = {
    "gpt": {"position": "learned", "norm": "layernorm", "mlp": "gelu", "tie_embeddings": True, "bias": True},
    "llama": {"position": "rope", "norm": "rmsnorm", "mlp": "swiglu", "tie_embeddings": False, "bias": False},
}
POSITIONS = ("learned", "rope")  # learned absolute embeddings | rotary embeddings on q and k (Su et al.)
NORMS = ("layernorm", "rmsnorm")
ROPE_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# model.rope_scaling with rope_type yarn (DeepSeek-V3): required keys, then optional ones (transformers' defaults)
YARN_KEYS = ("factor", "original_max_position_embeddings")
YARN_OPTIONAL_KEYS = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim")


@dataclass
class MoEConfig:
    """`model.moe.*`: a mixture of experts in place of the MLP (mlplat.model.moe, docs/moe.md)."""

    num_experts: int = 0  # routed experts per MoE layer; 0 = a dense MLP in every layer
    top_k: int = 2  # experts each token is sent to
    ffn_hidden: int | None = None  # one expert's MLP width; null = model.ffn_hidden resolved
    shared_experts: int = 0  # experts every token goes through, as one MLP of shared_experts·ffn_hidden width
    shared_gate: bool = False  # the shared experts' output scaled by sigmoid(x·w) per token (Qwen2-MoE)
    dense_layers: int = 0  # the first layers keep a dense MLP (DeepSeek-V3's first three)
    router: str = "softmax"  # softmax (Mixtral, Qwen) | sigmoid (DeepSeek-V3, GLM-4.5: each expert's own score)
    norm_topk_prob: bool = False  # the k chosen scores renormalised to sum 1 (Mixtral, Qwen3, DeepSeek-V3, GLM-4.5)
    # the routed experts' gates times this, after any renormalisation (DeepSeek-V3: 2.5; GLM-4.5: 1 or 2.5)
    routed_scaling_factor: float = 1.0
    aux_loss_coeff: float = 0.0  # the Switch/GShard load-balancing loss's weight, per layer, summed over layers
    z_loss_coeff: float = 0.0  # the router z-loss's weight (ST-MoE): mean logsumexp(logits)² per layer
    # null = dropless; a number c: each expert takes at most ceil(c·tokens·top_k/num_experts) of a micro-batch's
    # assignments, in token order, and drops the rest (docs/moe.md)
    capacity_factor: float | None = None
    # > 0: aux-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores for the choice only, moved by
    # this much towards balance after each step from the step's token counts; 0 = off
    bias_update_rate: float = 0.0
    # the per-expert bias (DeepSeek-V3's correction bias) chooses the experts even when bias_update_rate is 0 (a
    # fine-tune of DeepSeek-V3 or GLM-4.5 routes as the release); bias_update_rate > 0 implies it
    expert_bias: bool = False
    # how tokens reach the ranks of their experts under parallel.ep > 1 (mlplat.parallel.dispatch): alltoall
    # (each token to its experts' ranks and back) | allgather (every rank sees the ep group's tokens) |
    # node_alltoall (each token across nodes once per node, then to its experts' ranks: parallel.ep_per_node)
    dispatcher: str = "alltoall"
    # the tokens dispatched to their experts in FP8 (e4m3, one fp32 scale per row, as DeepSeek-V3), quantised at the
    # dispatch whatever the layout (ep = 1 too); their outputs and the gradients travel back in the run's precision
    fp8_dispatch: bool = False
    # What the cost models (dry run, planner) plan for, not what the layer does: the tokens of the busiest expert
    # rank over the mean (max/mean, >= 1; 1 = perfect balance), `mlplat.perf.memory.expert_imbalance` from counts
    plan_imbalance: float = 1.0
    # group-limited routing (DeepSeek-V3): the experts in n_groups equal groups, a token's k chosen among the experts
    # of its topk_groups best groups only (docs/moe.md); n_groups=1 = every expert eligible
    n_groups: int = 1
    topk_groups: int = 1
    # the sequence-level balancing loss's weight (DeepSeek-V3): the aux loss per sequence, averaged over sequences
    seq_aux_loss_coeff: float = 0.0

    @property
    def enabled(self) -> bool:
        return self.num_experts > 0

    @property
    def has_expert_bias(self) -> bool:
        """Whether each MoE layer holds the per-expert bias that chooses its experts (`expert_bias`, or moved by
        aux-loss-free balancing)."""
        return self.expert_bias or self.bias_update_rate > 0


@dataclass
class MLAConfig:
    """`model.mla.*`: the head shapes of multi-head latent attention, model.attention=mla (DeepSeek-V2/V3,
    docs/parallelism.md); read only under it."""

    q_lora_rank: int | None = 1536  # the query's latent width; null = no query compression (DeepSeek-V2-Lite)
    kv_lora_rank: int = 512  # the keys' and values' shared latent width (what a decoding cache holds)
    qk_nope_head_dim: int = 128  # a query/key head's channels without rotary embedding
    qk_rope_head_dim: int = 64  # a query/key head's rotated channels (the key's: one head shared by all)
    v_head_dim: int = 128  # a value head's channels (the attention output's per head)


@dataclass
class MTPConfig:
    """`model.mtp.*`: DeepSeek-V3's multi-token prediction (mlplat.model.mtp, docs/mtp.md)."""

    # D: sequential modules after the last layer, module k predicting token i+k+1 from position i; 0 = off
    depth: int = 0
    # λ: the objective adds λ/D times the sum of the modules' losses (DeepSeek-V3: 0.3, later 0.1)
    loss_coeff: float = 0.3

    @property
    def enabled(self) -> bool:
        return self.depth > 0


@dataclass
class ModelConfig:
    """`model.*`: the transformer's shape and architecture (conf/model/)."""

    arch: str = "gpt"  # gpt | llama: sets the defaults of position, norm, mlp, tie_embeddings and bias (ARCHS)
    n_layers: int = 4  # l: transformer layers
    hidden: int = 128  # h: hidden size
    n_heads: int = 4  # a: attention (query) heads
    n_kv_heads: int | None = None  # key/value heads (grouped-query attention; 1 = multi-query); null = n_heads
    # d: each attention head's channels; null = hidden/n_heads. Set, the heads need not tile the hidden size (Qwen3:
    # 128 at hidden 2048 with 32 heads): QKV maps h to (n_heads + 2·n_kv_heads)·d, the output projection n_heads·d to h
    head_dim: int | None = None
    seq_len: int = 128  # s: tokens per sequence
    # V: null = the tokenizer's vocabulary (256 for byte, 50257 for gpt2), resolved by mlplat.train.preflight (it
    # reads the tokenizer); a number must hold every token id. Padded further by vocab_pad_multiple·tp.
    vocab_size: int | None = None
    dropout: float = 0.0  # on the embeddings, attention probabilities and both residual branches
    # MLP width (at least 1); null = model.mlp's (mlplat.specs.mlps): 4·hidden for gelu (the paper), 8·hidden/3
    # rounded up to a multiple of 256 for swiglu (Llama's rule, the same weights as 4·hidden in two matrices)
    ffn_hidden: int | None = None
    init_std: float = 0.02  # normal init; output projections scaled by 1/sqrt(2·l) (mlplat.model.init)
    vocab_pad_multiple: int = 128  # vocabulary padded to a multiple of this × tp
    activation: str = "gelu"  # mlp=gelu: gelu (exact, erf) | gelu_tanh (GPT-2's approximation, `gelu_new`)
    position: str | None = None  # learned | rope; null = the arch's
    rope_theta: float = 10000.0  # position=rope: the base of the rotary frequencies (Llama 3: 500000)
    # position=rope: the channels of each head rotated, its first rotary_dim (partial rotary: GLM-4.5's half of 128,
    # partial_rotary_factor 0.5); the rest pass unrotated; null = the whole head
    rotary_dim: int | None = None
    # position=rope: null, or Llama 3.1's frequency scaling {factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings} (rope_type llama3 in transformers)
    rope_scaling: dict | None = None
    norm: str | None = None  # layernorm | rmsnorm; null = the arch's
    norm_eps: float = 1e-5  # the norms' epsilon
    mlp: str | None = None  # gelu | swiglu | another registered MLP (mlplat.specs.mlps); null = the arch's
    tie_embeddings: bool | None = None  # the output layer is the word embedding; null = the arch's
    bias: bool | None = None  # biases on the linear layers (and LayerNorms); null = the arch's
    qkv_bias: bool | None = None  # a bias on the QKV projection alone (Qwen2); null = model.bias
    qk_norm: bool = False  # an RMSNorm over each head's channels of q and of k, before the rotation (Qwen3)
    # mha (multi-head attention, grouped K/V heads per n_kv_heads) | another registered attention
    # (mlplat.specs.attentions); any arch
    attention: str = attentions.DEFAULT
    moe: MoEConfig = field(default_factory=MoEConfig)  # mixture of experts (model.moe.*; off by default)
    mla: MLAConfig = field(default_factory=MLAConfig)  # latent attention's head shapes (model.mla.*; attention=mla)
    mtp: MTPConfig = field(default_factory=MTPConfig)  # multi-token prediction (model.mtp.*; off by default)

    def __post_init__(self):
        # a group of keys rebuilt from a mapping (a manifest, dataclasses.asdict)
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Mapping) and f.default_factory is not MISSING and is_dataclass(
                    default := f.default_factory()):
                setattr(self, f.name, type(default)(**value))

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer` (global index) holds experts rather than the dense MLP."""
        return self.moe.enabled and layer >= self.moe.dense_layers

    @property
    def moe_layer_ids(self) -> list[int]:
        """The global indices of the layers that hold experts (none for a dense model), the multi-token prediction
        modules' layers l .. l + D - 1 included."""
        return [i for i in range(self.n_layers + self.mtp.depth) if self.is_moe_layer(i)]

    @property
    def expert_ffn(self) -> int:
        """One expert's width, model.moe.ffn_hidden resolved."""
        return self.moe.ffn_hidden or self.ffn

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_size(self) -> int:
        """d: one attention head's channels, model.head_dim resolved (null = hidden/n_heads)."""
        return self.head_dim or self.hidden // self.n_heads

    @property
    def rotary_channels(self) -> int:
        """The channels of each head the rotary embedding turns, model.rotary_dim resolved (null = the head)."""
        return self.rotary_dim or self.head_size

    @property
    def attention_width(self) -> int:
        """a·d: the queries' width, the attention output's (the output projection's input); h unless model.head_dim
        says otherwise."""
        return self.n_heads * self.head_size

    def weights(self) -> dict[str, Any]:
        """The keys that decide the model's tensors (which there are, and their shapes), nulls resolved: a checkpoint
        resumes only into a model that agrees on each (mlplat.train.check_resumed_model). The sequence length only
        for learned positions (their table has a row per position; rotary ones have none). `model.arch` through the
        keys it defaults (position, norm, mlp, tie_embeddings, bias): it shapes nothing else. Under `model.moe`, the
        keys that add, drop or reshape a table; the routing keys (top_k, router, capacity, ...) shape none. Under
        `model.mtp`, the depth (the loss weight shapes none)."""
        arch = ARCHS.get(self.arch, ARCHS["gpt"])
        own = {k: getattr(self, k) if getattr(self, k) is not None else arch[k] for k in arch}
        out = {"n_layers": self.n_layers, "hidden": self.hidden, "n_heads": self.n_heads, "n_kv_heads": self.kv_heads,
               # the head size only where it is not hidden/n_heads (which the keys above decide)
               **({"head_dim": self.head_size} if self.attention_width != self.hidden else {}),
               "ffn_hidden": self.ffn, "vocab_size": self.vocab_size, **own,
               "qkv_bias": self.qkv_bias if self.qkv_bias is not None else own["bias"], "qk_norm": self.qk_norm,
               # another attention's tables differ (a checkpoint before the key is the default's)
               **({"attention": self.attention} if self.attention != attentions.DEFAULT else {})}
        if own["position"] == "learned":
            out["seq_len"] = self.seq_len
        if self.attention == "mla":  # its head shapes, in place of the multi-head ones'
            out.update({f"mla.{k}": v for k, v in asdict(self.mla).items()})
        moe = self.moe
        out["moe.num_experts"] = moe.num_experts
        if moe.enabled:  # the experts' tables, the shared experts' MLP and its gate, and which layers hold them
            out.update({"moe.ffn_hidden": self.expert_ffn, "moe.shared_experts": moe.shared_experts,
                        "moe.dense_layers": moe.dense_layers})
            if moe.shared_experts:
                out["moe.shared_gate"] = moe.shared_gate
        if self.mtp.enabled:  # D more modules (a checkpoint before the key has none)
            out["mtp.depth"] = self.mtp.depth
        return out

    def padded_vocab(self, tp: int = 1) -> int:
        """The vocabulary tables' rows: vocab_size padded to a multiple of vocab_pad_multiple·t."""
        return pad_vocab_size(self.vocab_size, tp, self.vocab_pad_multiple)

    def kv_replicas(self, tp: int) -> int:
        """The tensor-parallel ranks holding each key/value head: t/n_kv_heads when there are fewer heads than
        ranks (the head replicated on them; validation makes t a multiple), else 1 (whole heads of its own)."""
        return max(1, tp // self.kv_heads)

    @property
    def attention_entry(self) -> attentions.Attention:
        """model.attention's registered entry (`mlplat.specs.attentions`)."""
        return attentions.get(self.attention)

    @property
    def mlp_entry(self) -> mlps.MLP:
        """model.mlp's registered entry (`mlplat.specs.mlps`), a null model.mlp resolved by model.arch."""
        return mlps.get(self.mlp or ARCHS.get(self.arch, ARCHS["gpt"])["mlp"])

    @property
    def ffn(self) -> int:
        """The MLP width, ffn_hidden resolved."""
        return self.ffn_hidden or self.mlp_entry.width(self.hidden)




@dataclass
class ParallelConfig:
    """`parallel.*`: the PTD-P layout and its batch split (conf/parallel/)."""

    tp: int = 1  # t: tensor-parallel size (inside a node)
    pp: int = 1  # p: pipeline-parallel size
    vpp: int = 1  # v: model chunks (virtual stages) per pipeline rank; 1 = not interleaved
    dp: int | None = None  # d: data-parallel size; null = world size / (t·c·p)
    cp: int = 1  # c: context-parallel size: each rank holds 1/c of every sequence (ring attention)
    # Expert parallelism (docs/moe.md), folded over the t·c·d ranks of a pipeline stage:
    # the ranks the experts of an MoE layer are split over (each holds num_experts/ep whole experts); null = as
    # many as a stage allows: the largest divisor of t·c·d that divides model.moe.num_experts (1 for a dense model)
    ep: int | None = 1
    etp: int | None = None  # each expert's tensor-parallel ranks: 1 or t; null = t when ep = 1, else 1
    # HSDP: with optim.sharding (optim | params), shard over groups of this many of the d·c replicas and replicate
    # across the groups (their gradients all-reduced once per step); null = all d·c (docs/parallelism.md)
    dp_shard: int | None = None
    # the ep ranks of one node, the nodes the node dispatcher sends a token across once each (model.moe.dispatcher=
    # node_alltoall, docs/moe.md); null = a node's: gcd(ep, trainer.devices) under that dispatcher
    ep_per_node: int | None = None
    # a schedule registered in mlplat.parallel.layout.registry (gpipe, 1f1b, interleaved, zb_h1, zbv, ...)
    schedule: str = DEFAULT_SCHEDULE
    micro_batch_size: int = 8  # b: sequences per micro-batch
    global_batch_size: int = 16  # B = b·m·d sequences per optimizer step
    scatter_gather: bool = True  # send 1/t of each inter-stage activation and all-gather it on arrival
    sequence_parallel: bool = False  # LayerNorm/dropout regions hold 1/t of the sequence (needs tp > 1)
    timeout_s: int = 120  # a collective or transfer waiting longer than this fails the job (a rank died)
    # Uneven pipeline stages (the other chunks split the rest evenly; null = an even split, where the layers do not
    # split evenly, one that counts the MTP modules as layers of the last chunk):
    first_stage_layers: int | None = None  # the transformer layers of the chunk holding the embedding (chunk 0)
    last_stage_layers: int | None = None  # the transformer layers of the chunk computing the loss (the last chunk)

    @property
    def pipeline(self) -> PipelineLayout:
        """The pipeline layout (p, v, schedule, the uneven split): the chunks, which rank holds which, their
        layers."""
        return PipelineLayout.of(self)

    @property
    def world_size(self) -> int:
        """t·c·p·d (mlplat.parallel.layout.dims.ParallelDims; parallel.dp resolved)."""
        return ParallelDims.of(self).world_size

    @property
    def num_micro_batches(self) -> int:
        """m: micro-batches per pipeline per optimizer step (mlplat.parallel.layout.dims.ParallelDims)."""
        return ParallelDims.of(self).num_micro_batches


@dataclass
class KernelsConfig:
    """`kernels.*`: how each layer computes (conf/kernels/)."""

    attention: str = "auto"  # flash (flash-attn) | sdpa (torch SDPA) | math (explicit reference) | auto
    fused: bool = False  # fused bias+GeLU, bias+dropout+add, scale+mask+softmax (torch.compile)
    recompute: str = "none"  # none | selective (attention core) | full (whole transformer layer); dropout replayed
    # none | tensorwise | rowwise | blockwise: the transformer layers' GEMMs (attention projections, MLP) in FP8,
    # scaled by each tensor's, row's or 128-block's amax (mlplat.parallel.fp8)
    fp8: str = "none"


@dataclass
class DataConfig:
    """`data.*`: the token source (conf/data/)."""

    name: str = "pydoc"  # pydoc (embedded) | text | indexed
    # Path keys (path, tokenizer, prefix, blend's prefixes, cache_dir; ckpt_path and init_from at the top level):
    # a leading ~ is the home directory (expanded when the typed config is built).
    path: str | None = None  # data=text: a .txt file or a folder of them
    val_fraction: float = 0.05  # pydoc/text: the last fraction of the token stream is validation
    num_workers: int = 0  # DataLoader worker processes
    # byte | gpt2 | a tokenizer.json or folder | a Hugging Face hub name (mlplat.data.tokenizer);
    # null: with data=indexed the tokenizer recorded in PREFIX.meta.json by mlplat.data.preprocess; with
    # init_from the tokenizer files of that directory (if it has any); otherwise byte.
    tokenizer: str | None = None
    prefix: str | None = None  # data=indexed: PREFIX of PREFIX.bin/PREFIX.idx (Megatron-Core's format)
    blend: list | None = None  # data=indexed, instead of prefix: [W1, PREFIX1, W2, PREFIX2, ...], W > 0
    split: Any = "969,30,1"  # data=indexed: train,valid,test weights over each prefix's documents
    cache_dir: str | None = None  # sample indices: null = next to the data (else $MLPLAT_CACHE, ~/.cache/mlplat)
    record_samples: bool = False  # write DIR/samples.csv: each step's sample ids (data-parallel rank 0's share)
    # Packed documents (Megatron's reset_position_ids, reset_attention_mask, eod_mask_loss): a window's documents,
    # delimited by the tokenizer's end-of-document token, attend only within themselves, their positions start
    # at 0, and the end-of-document token's prediction of the next document's first token is not trained on.
    pack: bool = False


MUON_UPDATE_SCALES = ("moonlight", "spectral")  # optim.muon.update_scale (mlplat.optim.muon.update_scale)


@dataclass
class MuonConfig:
    """`optim.muon.*`: Muon's keys, read when optim.name=muon (mlplat.optim.muon; docs/precision.md)."""

    lr: float | None = None  # the hidden matrices' peak learning rate (scheduled as optim.lr); null = optim.lr
    momentum: float = 0.95  # the momentum's decay
    nesterov: bool = True  # orthogonalise grad + momentum·buffer (Nesterov) instead of the buffer
    ns_steps: int = 5  # Newton-Schulz iterations of the quintic
    weight_decay: float = 0.1  # decoupled, on the hidden matrices (optim.weight_decay stays AdamW's)
    # moonlight: 0.2·sqrt(max(A, B)), the update's RMS of AdamW's (optim.lr carries over) | spectral: sqrt(max(1, A/B))
    update_scale: str = "moonlight"
    # QK-clip's threshold tau (Kimi K2's MuonClip): a head whose largest pre-softmax logit over the step exceeds it has
    # its query and key rows scaled by sqrt(tau/max) after the step; null = off (nothing tracked)
    qk_clip: float | None = None


@dataclass
class OptimConfig:
    """`optim.*`: the optimizer and its learning-rate schedule (conf/optim/)."""

    # the optimizer, one of those registered in mlplat.optim.factory (adamw: torch's AdamW, or on the main weights)
    name: str = DEFAULT_OPTIMIZER
    lr: float = 6e-3  # peak learning rate, reached after warmup_steps
    min_lr: float = 6e-5  # cosine decay ends here at optim.lr_decay_steps, and the rate holds it after
    # the step the cosine reaches min_lr; null = trainer.max_steps. A checkpoint keeps its run's: a resume with a longer
    # trainer.max_steps continues at min_lr unless this is given (mlplat.lr_schedule)
    lr_decay_steps: int | None = None
    weight_decay: float = 0.1  # on matrices only (no decay on biases and LayerNorm gains)
    betas: tuple[float, float] = (0.9, 0.95)  # Adam's (beta1, beta2)
    eps: float = 1e-8  # Adam's epsilon
    warmup_steps: int = 50  # linear warm-up from lr/warmup_steps to lr
    grad_clip: float = 1.0  # global gradient-norm clipping over all ranks; 0 = off
    distributed: bool = False  # true: optim.sharding=optim (its alias; kept for configs that name it)
    # over the data-parallel ranks, shard: none | optim (main weights and optimizer state: ZeRO-1, the distributed
    # optimizer) | params (also the weights and gradients, gathered per layer: ZeRO-3 / FSDP)
    sharding: str = "none"
    # data-parallel gradient reduction: main (the main gradients' dtype: fp32, fp64 under 64-true) | bf16
    # (half the bytes; needs trainer.precision=bf16-megatron)
    grad_reduce_dtype: str = "main"
    # optimizer post-validation (mlplat.step.post_validation): step at once, the clipping norm and the inf/NaN
    # check read during the next step (steps run back to back); a step they reject is redone from a saved copy
    post_validate: bool = False
    # steps in a row skipped for an inf/NaN loss or gradient norm that stop the run (one line, exit status 2)
    max_skipped_steps: int = 10
    muon: MuonConfig = field(default_factory=MuonConfig)  # Muon's keys (optim.muon.*; with optim.name=muon)

    def __post_init__(self):
        if isinstance(self.muon, Mapping):  # rebuilt from a mapping (a manifest, dataclasses.asdict)
            self.muon = MuonConfig(**self.muon)


@dataclass
class TrainerConfig:
    """`trainer.*`: what Lightning's Trainer gets (conf/trainer/)."""

    accelerator: str = "cpu"  # cpu (gloo) | gpu (NCCL)
    devices: int | None = None  # ranks per node; null = what the layout needs (t·p·d / num_nodes)
    num_nodes: int = 1  # nodes of the job
    # 64-true | 32-true | bf16-mixed | 16-mixed (dynamic loss scaling) | bf16-true | bf16-megatron | 16-megatron
    # (bf16/fp16 weights with fp32 main weights and gradients; 16-megatron with dynamic loss scaling)
    precision: str = "32-true"
    max_steps: int = 120  # optimizer steps of the run
    val_check_interval: int = 60  # validate every this many steps, and after the last step
    limit_val_batches: int = 4  # validation batches per check; 0 = no validation
    log_every_n_steps: int = 1  # logging and progress-bar refresh period
    # restarts of every rank after one fails, each resuming from the last checkpoint (torch's elastic agent,
    # mlplat.lightning.restarts); 0 = a failed rank ends the job
    max_restarts: int = 0


@dataclass
class LoggerConfig:
    """`logger.*`: where metrics go besides DIR/metrics.csv (conf/logger/)."""

    name: str = "wandb"  # wandb | csv | none
    project: str = "mlplat"  # W&B project
    entity: str | None = None  # W&B entity (team); null = the API key's default
    mode: str | None = None  # W&B mode: online | offline; null = online with WANDB_API_KEY set, otherwise offline
    tags: list = field(default_factory=list)  # W&B run tags


@dataclass
class CheckpointConfig:
    """`checkpoint.*`: sharded checkpoints, periodic and at the run's end."""

    # N > 0: save DIR/checkpoints/step-<N>/ every N steps and at the last step; 0 = off; null = the cadence of the
    # checkpoint resumed (ckpt_path; mlplat.train.preflight reads it), 0 when not resuming
    every_steps: int | None = None
    # true: also save the run's last step (trainer.max_steps) when every_steps is 0 (null on a fresh run), so a finished
    # run can be exported, sampled or continued; false with every_steps=0: no checkpoint at all
    save_last: bool = True
    timeout_s: int = 1800  # how long a collective after checkpoint/profile file I/O (save, verify, load) may wait
    # true: training goes on while a checkpoint is written (copied to host memory at the step, written and committed
    # behind; the next save and the run's end wait for it: docs/checkpoints.md#asynchronous-saves)
    async_save: bool = False
    # with async_save: where DCP plans and writes the save, `thread` (of each rank) or `process` (one per rank, spawned
    # at the first save and kept: docs/checkpoints.md#asynchronous-saves)
    async_mode: str = "thread"


@dataclass
class SampleConfig:
    """`sample.*`: the text generated through the pipeline at the end of training."""

    prompt: str = "The for statement is used to"  # the prompt, tokenized with the run's tokenizer
    max_new_tokens: int = 80  # tokens to generate; 0 = no sample
    temperature: float = 0.6  # 0 = greedy (mlplat.model.sampling)
    top_k: int = 0  # > 0: draw among the k most likely tokens only; 0 = off
    top_p: float = 0.95  # < 1: draw among the smallest set of tokens whose probability reaches top_p (nucleus)
    seed: int | None = None  # the draws' generator seed; null = the run's seed


@dataclass
class ProfileConfig:
    """`profile.*`: where the time of some steps goes (mlplat.parallel.profile; DIR/profile/)."""

    # [FROM, TO]: optimizer steps (1-based, inclusive) to profile; N alone = [N, N], that one step; null = off
    steps: list | None = None
    torch: bool = False  # also run torch.profiler over those steps (DIR/profile/torch/rank-K.json)


@dataclass
class StragglerConfig:
    """`straggler.*`: name a rank slower than the others of its pipeline stage (mlplat.parallel.straggler)."""

    every_steps: int | None = None  # N > 0: check every N optimizer steps; null or 0 = off
    threshold: float = 0.2  # name a rank whose work exceeds its peers' median by more than this fraction


@dataclass
class ClusterConfig:
    """`cluster.*`: the machine the dry run and the planner time a layout on (mlplat.perf.cluster;
    conf/cluster/). A null figure is the device's own (mlplat.perf.devices)."""

    name: str | None = None  # a label; null = the device's name
    device: str | None = None  # a100-80gb | h100-sxm | h200 | cpu | ...; null = a100-80gb on gpu, else cpu
    gpus_per_node: int | None = None  # devices (ranks) per node
    gpu_memory_gb: float | None = None  # GiB per device usable by one rank
    nvlink_gbps: float | None = None  # intra-node link rate per device per direction, Gb/s
    ib_gbps_per_gpu: float | None = None  # inter-node link rate per device, Gb/s
    nodes: int | None = None  # size of the machine, if known (the dry run warns past it)
    nvlink_efficiency: float = 0.8  # NCCL bus bandwidth / link rate, intra-node
    ib_efficiency: float = 0.9  # the same, inter-node
    nvlink_latency_us: float = 3.0  # per ring step, intra-node
    ib_latency_us: float = 8.0  # per ring step, inter-node
    hbm_efficiency: float = 0.8  # achieved share of the memory bandwidth (memory-bound kernels)
    overhead_gib: float | None = None  # per device: CUDA context, NCCL buffers; null = 2 (0.3 on cpu)
    usable_fraction: float = 0.95  # a layout fits when its worst device stays under this share of its memory
    fs_write_gbps: float | None = None  # the checkpoint file system's write rate, whole job, GB/s; null: unknown
    # A CPU box whose ranks are processes, measured by `python experiments/calibrate/calibrate.py` (all set or all null;
    # null on GPU clusters). nvlink_* then describe gloo between local processes.
    cpu_cores: float | None = None  # cores the ranks share
    cpu_background: float | None = None  # other jobs' runnable processes on those cores (0 on a quiet machine)
    cpu_gemm_gflops: float | None = None  # one thread's sustained GEMM rate, GFLOP/s
    cpu_memory_gbps: float | None = None  # one thread's element-wise traffic rate, GB/s
    cpu_op_us: float | None = None  # fixed cost of one forward op (dispatch, autograd bookkeeping), µs
    cpu_backward_op_us: float | None = None  # the same for one op of the backward pass, µs
    cpu_optimizer_us_per_tensor: float | None = None  # grad-norm clipping + AdamW step, per parameter tensor, µs
    cpu_optimizer_ns_per_param: float | None = None  # ... and per parameter, ns
    cpu_idle_wakeup_us: float | None = None  # wait per message hand-off while cores idle (waking the peer), µs
    cpu_wakeup_us: float | None = None  # wait per message hand-off while cores are crowded (the peer's turn), µs
    cpu_loop_us: float | None = None  # the Lightning loop around a step (callbacks, logging, data), per rank, µs


@dataclass
class RunConfig:
    """The whole run: one section per config group, and the top-level keys."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    seed: int = 1234  # seeds the weights, dropout and the data order
    dry_run: bool = False  # plan the run (parameters, memory, FLOPs, predicted throughput) and exit
    ckpt_path: str | None = None  # resume from a checkpoint directory, or `last` for this run's newest
    init_from: str | None = None  # a transformers directory (docs/huggingface.md lists the classes): its model, weights

    @property
    def dims(self) -> ParallelDims:
        """The derived layout facts (world size, m, the chunk placement, sequence parallelism) of the parallel keys
        as `validate` resolved them (parallel.dp, parallel.ep)."""
        if self.parallel.dp is None or self.parallel.ep is None:
            raise AttributeError("RunConfig.dims needs the layout mlplat.config.validate (load_config) resolves")
        return ParallelDims.of(self.parallel)


_TOP_KEYS = ("seed", "dry_run", "ckpt_path", "init_from")
# Keys that hold file system paths: a leading ~ is expanded (`data.blend` holds prefixes between its weights).
PATH_KEYS = {"data": ("path", "tokenizer", "prefix", "cache_dir", "blend"), "": ("ckpt_path", "init_from")}


def _expand_path(value: Any) -> Any:
    """`~/x` as the home directory's x (strings only; a blend's weights and hub names pass unchanged)."""
    if isinstance(value, str) and value.startswith("~"):
        return os.path.expanduser(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_expand_path(v) for v in value)
    return value
_SECTIONS = {f.name: f.default_factory for f in fields(RunConfig) if f.default_factory is not MISSING}  # type: ignore[misc]


def _kind(annotation: Any) -> tuple[str, bool]:
    """('int' | 'float' | 'bool' | 'str' | 'other', nullable) from a field's annotation string."""
    text = str(annotation).replace(" ", "")
    nullable = "None" in text.split("|")
    base = [part for part in text.split("|") if part != "None"]
    kind = base[0] if len(base) == 1 and base[0] in ("int", "float", "bool", "str") else "other"
    return kind, nullable


def _check_value(key: str, annotation: Any, value: Any) -> Any:
    """The value converted to the field's type, or a ConfigError naming the key, the value and the rule."""
    kind, nullable = _kind(annotation)
    if value is None:
        _require(nullable, f"{key}=null is not allowed: {key} needs a value")
        return None
    if kind == "bool" and not isinstance(value, bool):
        raise ConfigError(f"{key}={value!r} must be true or false")
    if kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{key}={value!r} must be an integer")
    if kind == "float" and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ConfigError(f"{key}={value!r} must be a number")
    if kind == "float" and not math.isfinite(value):  # no key means anything by inf or nan: a NaN run otherwise
        raise ConfigError(f"{key}={value} must be a finite number")
    if kind == "str" and isinstance(value, (dict, list, tuple)):
        raise ConfigError(f"{key}={value!r} must be a single value")
    if kind == "str" and not isinstance(value, str):
        value = str(value)  # e.g. trainer.precision=32 arrives as an int
    return value


def _typed(section: str, cls: type, raw: Mapping[str, Any]) -> Any:
    """Build a section dataclass from known keys, checking each value's type; unknown keys are refused."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{section}={raw!r} must be a group of keys (e.g. {section}.KEY=VALUE)")
    obj = cls()
    known = {f.name: f for f in fields(cls)}
    for name in raw:
        _require(name in known, f"{section}.{name} is not a known key (known: {', '.join(known)})")
    for name, f in known.items():
        if name not in raw:
            continue
        if is_dataclass(default := getattr(obj, name)):  # a group of keys of its own (model.moe.*, ...)
            setattr(obj, name, _typed(f"{section}.{name}", type(default), raw[name] if raw[name] is not None else {}))
            continue
        value = _check_value(f"{section}.{name}", f.type, raw[name])
        if isinstance(getattr(obj, name), tuple) and value is not None:
            _require(isinstance(value, (list, tuple)), f"{section}.{name}={value!r} must be a list, e.g. "
                                                       f"{section}.{name}=[{', '.join(map(str, getattr(obj, name)))}]")
            value = tuple(value)
        if name in PATH_KEYS.get(section, ()):
            value = _expand_path(value)
        setattr(obj, name, value)
    return obj


def from_dict(raw: Mapping[str, Any]) -> RunConfig:
    """A RunConfig from a plain (resolved) mapping, without validation (beyond keys and value types)."""
    cfg = RunConfig()
    top = {f.name: f for f in fields(RunConfig)}
    for name in raw:
        _require(name in top or name == "hydra", f"{name} is not a known top-level key (known: {', '.join(top)})")
    for name, factory in _SECTIONS.items():
        if name in raw and raw[name] is not None:
            setattr(cfg, name, _typed(name, type(factory()), raw[name]))
    for key in _TOP_KEYS:
        if key in raw:
            value = _check_value(key, top[key].type, raw[key])
            setattr(cfg, key, _expand_path(value) if key in PATH_KEYS[""] else value)
    return cfg


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


CPU_KEYS = tuple(f.name for f in fields(ClusterConfig) if f.name.startswith("cpu_"))  # Host's fields, prefixed


def from_raw(raw: Any) -> RunConfig:
    """From a Hydra DictConfig (or a plain mapping) to a typed RunConfig, not yet validated."""
    try:
        from omegaconf import DictConfig, OmegaConf
        from omegaconf.errors import MissingMandatoryValue
    except ImportError:  # pragma: no cover
        DictConfig = ()  # type: ignore[assignment]
    if isinstance(raw, DictConfig):
        # Only our own sections: `hydra:` interpolations elsewhere need a running Hydra app.
        plain: dict[str, Any] = {}
        for key in raw:
            _require(key in _SECTIONS or key in _TOP_KEYS or key == "hydra",
                     f"{key} is not a known top-level key (known: {', '.join([*_SECTIONS, *_TOP_KEYS])})")
        for key in list(_SECTIONS) + list(_TOP_KEYS):
            if key not in raw:
                continue
            try:
                node = raw[key]
                plain[key] = OmegaConf.to_container(node, resolve=True, throw_on_missing=True) \
                    if isinstance(node, DictConfig) else node
            except MissingMandatoryValue as e:
                nested = e.full_key and not str(e.full_key).startswith(key)
                name = f"{key}.{e.full_key}" if nested else (e.full_key or key)
                raise ConfigError(f"{name} is missing: set {name}=...") from None
        raw = plain
    return from_dict(raw)
