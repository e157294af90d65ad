"""Shared pieces of the "parallel == one process" proofs (tests/lightning/test_equivalence.py).

Every run builds the same tiny GPT as a `TrainStep` (float64: the config's 64-true) and drives it with
`TrainStep.forward_backward` or `TrainStep.run` (no Trainer). The reference is the same RunConfig at tp=pp=dp=1 in
one process.
Parallel results are brought back to full (tp=1, unpadded) tensors keyed by full-model parameter names, so a
layout's result and the reference can be compared name by name.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
import torch.distributed as dist

from mlplat.config import RunConfig, load_config
from mlplat.data.sampler import DataParallelSampler
from mlplat.model.decoder import WORD_EMBEDDING, DecoderChunk
from mlplat.model.init import OUTPUT_LAYER
from mlplat.parallel.grid import ParallelGrid
from mlplat.parallel.tensor import gather_from_tensor_parallel, gather_full, partition_dim_of, shared_ranges
from mlplat.step import TrainStep

# The tiny model: 8 layers so that pp=4 with v=2 still gives every chunk one layer; vocabulary 250 is padded to
# 256 at tp=1,2 and to 512 at tp=4 (multiple 128·tp), so padding differs between layouts.
MODEL = dict(n_layers=8, hidden=32, n_heads=4, seq_len=16, vocab_size=250, dropout=0.0)
VOCAB = MODEL["vocab_size"]
# the keys a test may set over MODEL (make_cfg's `model`)
MODEL_KEYS = ("arch", "n_kv_heads", "qkv_bias", "qk_norm", "n_layers", "head_dim", "attention", "mla", "rope_scaling",
              "tie_embeddings", "moe", "mtp")
SEED = 1234
DATA_SEED = 99


def make_cfg(tp=1, pp=1, vpp=1, dp=1, schedule="1f1b", micro=2, global_batch=8, scatter_gather=True,
             grad_clip=0.0, recompute="none", fused=False, steps=5, lr=3e-3, warmup=2, sequence_parallel=False,
             dropout=0.0, distributed=False, post_validate=False, fp8="none", model=None, cp=1,
             precision="64-true", first_stage_layers=None, last_stage_layers=None, ep=1, etp=None,
             attention="math", optim=None, ep_per_node=None) -> RunConfig:
    """`model`: keys over MODEL's (MODEL_KEYS: the keys `reference` tells apart); `attention`: kernels.attention;
    `optim`: optim.* keys over the ones set here (name, muon: keys `reference` tells apart too)."""
    raw = {
        "model": dict(MODEL, dropout=dropout, **(model or {})),
        "parallel": dict(tp=tp, pp=pp, vpp=vpp, dp=dp, cp=cp, schedule=schedule, micro_batch_size=micro,
                         global_batch_size=global_batch, scatter_gather=scatter_gather,
                         sequence_parallel=sequence_parallel, first_stage_layers=first_stage_layers,
                         last_stage_layers=last_stage_layers, ep=ep, etp=etp, ep_per_node=ep_per_node),
        "kernels": dict(attention=attention, recompute=recompute, fused=fused, fp8=fp8),
        "optim": dict(lr=lr, min_lr=lr / 10, weight_decay=0.1, warmup_steps=warmup, grad_clip=grad_clip,
                      distributed=distributed, post_validate=post_validate, **(optim or {})),
        "trainer": dict(max_steps=steps, precision=precision),
        "logger": dict(name="none"),
        "seed": SEED,
    }
    return load_config(raw, world_size=tp * pp * dp * cp, check_data=False)  # token ids of its own


def build_module(cfg: RunConfig, grid: ParallelGrid, *, overlap: bool = True,
                 bucket_bytes: int | None = None) -> TrainStep:
    """This rank's training step in float64, with the engine set up (the data-parallel reducer options given)."""
    options = {"overlap": overlap} if bucket_bytes is None else {"overlap": overlap, "bucket_bytes": bucket_bytes}
    step = TrainStep(cfg, grid, **options)
    assert step.engine is not None
    return step


# ------------------------------------------------------------------------------------------------ data


def dataset(n_samples: int) -> torch.Tensor:
    """Fixed token windows [n, seq+1]: inputs are [:, :-1], labels [:, 1:]."""
    gen = torch.Generator().manual_seed(DATA_SEED)
    return torch.randint(0, VOCAB, (n_samples, MODEL["seq_len"] + 1), generator=gen)


def local_batches(cfg: RunConfig, dp_rank: int, n_steps: int, n_samples: int | None = None,
                  epoch: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This data-parallel rank's batch of each step, cut by DataParallelSampler as the DataModule does."""
    p = cfg.parallel
    n_samples = n_samples or n_steps * p.global_batch_size + 3  # a tail that the sampler drops
    data = dataset(n_samples)
    sampler = DataParallelSampler(n_samples, p.global_batch_size, p.dp, dp_rank, shuffle=True, seed=SEED)
    sampler.set_epoch(epoch)
    idx = torch.tensor(list(sampler))
    local = p.global_batch_size // p.dp
    out = []
    for step in range(n_steps):
        windows = data[idx[step * local:(step + 1) * local]]
        out.append((windows[:, :-1].contiguous(), windows[:, 1:].contiguous()))
    return out


# ------------------------------------------------------------------------------------------------ full view


def make_grid(cfg: RunConfig) -> ParallelGrid:
    """The grid of cfg's layout in the running world (its key/value heads' kv group included)."""
    return ParallelGrid.of(cfg.dims, kv_replicas=cfg.model.kv_replicas(cfg.parallel.tp),
                           ep_per_node=cfg.parallel.ep_per_node)


def _gather(t: torch.Tensor, param, grid) -> torch.Tensor:
    t = t.detach().clone()
    t.partition_dim = partition_dim_of(param)  # gather_full reads the split (and the row blocks) from the tensor
    if hasattr(param, "row_blocks"):
        t.row_blocks = param.row_blocks
    t.expert_parallel = getattr(param, "expert_parallel", False)
    return gather_full(t, grid).clone()


def _unpad(name: str, full: torch.Tensor, pads: dict) -> torch.Tensor:
    if name in (WORD_EMBEDDING, OUTPUT_LAYER):  # the vocabulary tables: padded for the layout's tp
        pads[name] = max(pads.get(name, 0.0), float(full[VOCAB:].abs().max()) if full.shape[0] > VOCAB else 0.0)
        return full[:VOCAB]
    return full


def full_tensors(module: TrainStep, grid, what: str) -> tuple[dict[str, torch.Tensor], float]:
    """{full name: full unpadded tensor} of this rank's parameters (what='param') or gradients ('grad'), and the
    largest magnitude found in the vocabulary padding rows (must stay 0). Collective over the tp group."""
    out, pads = {}, {}
    for key in sorted(module.chunks):
        for name, p in module.chunks[key].named_parameters():
            full = DecoderChunk.full_name(name)
            t = p.detach() if what == "param" else (p.grad if p.grad is not None else torch.zeros_like(p))
            out[full] = _unpad(full, _gather(t, p, grid), pads)
    return out, max(pads.values(), default=0.0)


def full_logits(module: TrainStep, grid, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of the single-chunk model (pp=1) on `tokens`, gathered over tp and cut to the real vocabulary."""
    with torch.no_grad():
        shard = module.chunks[0](tokens)
        return gather_from_tensor_parallel(shard, grid)[..., :VOCAB].clone()


# ------------------------------------------------------------------------------------------------ runs


def grads_run(cfg: RunConfig, grid, *, logits: bool = False, overlap: bool = True,
              bucket_bytes: int | None = None) -> dict:
    """One forward_backward (forward, backward, reductions, clipping) on step 0's batch."""
    module = build_module(cfg, grid, overlap=overlap, bucket_bytes=bucket_bytes)
    tokens, labels = local_batches(cfg, grid.dp_rank, 1)[0]
    out = {}
    if logits:
        out["logits"] = full_logits(module, grid, tokens)
    # The forward-only pass (validation) runs the same schedule without its backward half.
    out["val_loss"] = float(module.evaluate((tokens, labels)))
    assert all(p.grad is None for p in module.parameters()), "forward_only produced gradients"
    loss, norm = module.forward_backward((tokens, labels))
    out["loss"], out["norm"] = float(loss), float(norm)
    out["grads"], out["grad_pad"] = full_tensors(module, grid, "grad")
    out["scatter_gather"] = module.engine.comm.scatter_gather if module.engine.comm is not None else None
    return out


def grads_run_without_tp_sum(cfg: RunConfig, grid) -> dict:
    """`grads_run` with the tp sum of the gradients of parameters applied to each rank's own tokens or heads (the
    sequence-parallel norms, the router, the q/k norms) left out: the classic bug, a control the proofs must fail."""
    from mlplat.optim.buffers import ParamBuffers

    saved = ParamBuffers.reduce_sequence_parallel
    ParamBuffers.reduce_sequence_parallel = lambda self: None
    try:
        return grads_run(cfg, grid)
    finally:
        ParamBuffers.reduce_sequence_parallel = saved


def train_run(cfg: RunConfig, grid, n_steps: int) -> dict:
    """n_steps optimizer steps through TrainStep.run (zero_grad, the pipeline pass, AdamW, LambdaLR; post-validated
    under optim.post_validate, the last step settled as the end of training does). Per step, from its record: loss,
    grad norm, learning rate after it, redone steps so far, stepped first, the MoE balancing loss (None without) and
    expert load figures ({} without).
    `shared_rows`: this rank's copy of the key/value heads it shares with other tp ranks (full name -> flat values)."""
    module = build_module(cfg, grid)
    records = []
    for batch in local_batches(cfg, grid.dp_rank, n_steps):
        records += module.run(batch)
    records += [r for r in [module.settle()] if r is not None]
    assert [r.step for r in records] == list(range(1, n_steps + 1)), [r.step for r in records]
    module.finish()  # the distributed optimizer's last all-gathers, as the end of training waits for them
    with module.grads.full_weights():  # sharded parameters: gathered to be read
        params, pad = full_tensors(module, grid, "param")
        shared = {DecoderChunk.full_name(n): torch.cat([p.detach().reshape(-1)[a:b] for a, b in ranges])
                  for c in module.chunks.values() for n, p in c.named_parameters()
                  if (ranges := shared_ranges(p, grid))}
    return {"losses": [float(r.loss) for r in records], "norms": [float(r.grad_norm) for r in records],
            "lrs": [r.lr for r in records], "params": params, "param_pad": pad,
            "redone": [r.redone_steps or 0 for r in records], "eager": [r.eager for r in records],
            "aux": [None if r.moe_aux_loss is None else float(r.moe_aux_loss) for r in records],
            "loads": [{k: float(v) for k, v in (r.moe_load or {}).items()} for r in records],
            "mtp": [{k: float(v) for k, v in (r.mtp_loss or {}).items()} for r in records],
            "qk_clipped": [None if r.qk_clipped_heads is None else int(r.qk_clipped_heads) for r in records],
            "shared_rows": shared}


def _frozen(value):
    """A model key's value as a cache key: a group of keys (model.mla, model.rope_scaling) as sorted pairs."""
    if dataclasses.is_dataclass(value):
        value = dataclasses.asdict(value)
    if isinstance(value, dict):
        return (dict, tuple(sorted((k, _frozen(v)) for k, v in value.items())))
    return value


def _thawed(value):
    return {k: _thawed(v) for k, v in value[1]} if isinstance(value, tuple) and value[:1] == (dict,) else value


@functools.lru_cache(maxsize=None)
def _reference(key: tuple) -> dict:
    kind, micro, global_batch, grad_clip, steps, lr, warmup, model, (name, muon), fp8 = key
    cfg = make_cfg(micro=micro, global_batch=global_batch, grad_clip=grad_clip, steps=steps, lr=lr, warmup=warmup,
                   model={k: _thawed(v) for k, v in model}, optim=dict(name=name, muon=_thawed(muon)), fp8=fp8)
    grid = ParallelGrid()
    torch.set_num_threads(1)
    if kind == "grads":
        out = grads_run(cfg, grid, logits=True)
        # A plain single-process autograd pass (no pipeline engine, no reducers) checks the reference itself.
        module = build_module(cfg, grid)
        tokens, labels = local_batches(cfg, 0, 1)[0]
        chunk = module.chunks[0]
        losses = [chunk(t, y) for t, y in zip(tokens.split(micro), labels.split(micro))]
        torch.stack(losses).mean().backward()
        params = list(module.parameters())
        out["plain_loss"] = float(torch.stack(losses).mean().detach())
        out["plain_grads"] = {n: p.grad.detach()[:VOCAB].clone() if n in (WORD_EMBEDDING, OUTPUT_LAYER)
                              else p.grad.detach().clone()
                              for n, p in chunk.named_parameters()}
        out["torch_norm"] = float(torch.nn.utils.get_total_norm([p.grad for p in params]))
        return out
    return train_run(cfg, grid, steps)


def reference(cfg: RunConfig, kind: str) -> dict:
    """The one-process run of `cfg` (cached; computed in the calling process)."""
    p, o = cfg.parallel, cfg.optim
    return _reference((kind, p.micro_batch_size, p.global_batch_size, o.grad_clip, cfg.trainer.max_steps, o.lr,
                       o.warmup_steps, tuple((k, _frozen(getattr(cfg.model, k))) for k in MODEL_KEYS),
                       (o.name, _frozen(o.muon)), cfg.kernels.fp8))


def merge(results: list[dict], key: str) -> dict[str, list[torch.Tensor]]:
    """Per full name, every copy of it held by any rank (tp ranks, dp replicas, the tied copy on the last stage)."""
    merged: dict[str, list[torch.Tensor]] = {}
    for res in results:
        for name, t in res[key].items():
            merged.setdefault(name, []).append(t)
    return merged


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


@contextlib.contextmanager
def sent_bytes():
    """The bytes (numel · element size) of every point-to-point send this rank posts while active: the stages'
    messages, as they go on the wire."""
    sent: list[int] = []
    isend = dist.isend  # looked up now: the NCCL-strict transport may have wrapped it

    def counting(tensor, *args, **kwargs):
        sent.append(tensor.numel() * tensor.element_size())
        return isend(tensor, *args, **kwargs)

    dist.isend = counting
    try:
        yield sent
    finally:
        dist.isend = isend
