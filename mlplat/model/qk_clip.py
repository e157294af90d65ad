"""QK-clip (Kimi Team, "Kimi K2: Open Agentic Intelligence", 2025: MuonClip), `optim.muon.qk_clip` τ: after each
optimizer step, a head whose largest pre-softmax logit over the step's pass, S = max q·kᵀ/√d, exceeded τ has its query
and key weights scaled by √η each, η = τ/S, so that its logits on the same inputs are at most τ. It caps the logit
growth that Muon's updates, with their large spectral norm, let loose (Kimi K2's loss spikes); a head under τ is
left alone.

`QKClipStep` is its part in the training step (a `mlplat.step.hooks.StepHook`). Each attention layer tracks the
running max of its heads' logits over a training pass (`AttentionCore.logit_max`: every micro-batch, every ring block
under context parallelism; an extra pass over q·kᵀ, `mlplat.parallel.logit_max`, whatever the kernel). When the loss
is shared, before the optimizer steps, each rank writes its layers' heads into a [layers, heads] table of the whole
model, and one max all-reduce over the world gives every rank every head's S: the data-parallel replicas and
context-parallel ranks, which saw other tokens of the same heads, the tensor-parallel ranks holding other heads, the
pipeline stages holding other layers. From it each rank sets the factor of each of its query/key/value rows on the QKV
weight and bias (`qk_clip_scale`, [rows]): √η of the head on its query rows; on a key head's rows √η of the largest S
among the query heads that share it (grouped-query attention: the key scaled for its worst query head, so each of
them ends at most at τ); 1 on the value rows. The optimizer multiplies its main weights by them after its update
(`mlplat.optim.muon.MainParamsMuon`), its own shard only, and the model's weights follow when it publishes them: each
tensor-parallel rank scales its heads' rows (a key/value head replicated over several ranks alike on each: they read
the same table), the owner of a distributed optimizer's (or sharded parameters') shard the parameters it holds. The
bias of the rows is scaled too (Qwen2's): q = W·x + b scales with both. A redone step (post-validation) steps again
from the saved state and clips again with the same factors; the next pass's tracking does not touch them.

Multi-head latent attention (DeepSeek-V2/V3, `mlplat.model.mla`): a head's logit is q_nope·k_nope + q_rope·k_rope, the
rotary key k_rope one head shared by all. Kimi K2's MuonClip for it: √η on the head's q_nope rows (of q_up, or q
without query compression) and on its k_nope rows of kv_up, η on its q_rope rows, and the shared k_rope (kv_down's
rows) left alone, since scaling it would move every head's logits; each part of the logit then scales by η, and the
head's values are untouched. Every head has its own key, so no group takes its worst head's factor.

The step's count of clipped heads (heads over τ in the whole model) is logged as `qk_clipped_heads`."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from mlplat.config import ModelConfig
from mlplat.model.mla import LatentAttention
from mlplat.parallel.grid import dist_ready
from mlplat.parallel.hang import HangWatch


class QKClipStep:
    """This rank's attention layers' logit maxima over a step and the factors QK-clip scales their rows by."""

    values = 0  # nothing in the loss's all-reduce: the maxima have an all-reduce of their own (a max)

    def __init__(self, chunks: dict[int, nn.Module], model_cfg: ModelConfig, tau: float, device: torch.device,
                 watch: HangWatch):
        self.tau, self.watch = tau, watch
        self.per_kv_head = model_cfg.n_heads // model_cfg.kv_heads
        layers = {i: layer for chunk in chunks.values() for i, layer in
                  [*((i, chunk.layers[str(i)]) for i in chunk.layer_ids),  # and the modules', l + k
                   *((model_cfg.n_layers + k, m.layer) for k, m in enumerate(getattr(chunk, "mtp", None) or ()))]}
        self.attentions = {i: layer.attn for i, layer in layers.items()}
        rows = model_cfg.n_layers + (model_cfg.mtp.depth if model_cfg.mtp.enabled else 0)
        self.table = torch.full((rows, model_cfg.n_heads), float("-inf"), dtype=torch.float64, device=device)
        for attn in self.attentions.values():
            attn.logit_max = torch.full((attn.heads,), float("-inf"), dtype=torch.float64, device=device)
            attn.head_ids, attn.kv_head_ids = attn.head_ids.to(device), attn.kv_head_ids.to(device)
        self.clipped: torch.Tensor | None = None  # the last step's count of heads over τ

    def before_pass(self, loss_scale: float, micro_batches: int) -> None:
        for attn in self.attentions.values():
            attn.logit_max.fill_(float("-inf"))

    def fill(self, values: torch.Tensor) -> None:
        """Before the optimizer steps: the maxima over the world and the factors of this rank's rows."""
        self.table.fill_(float("-inf"))
        for i, attn in self.attentions.items():
            self.table[i, attn.head_ids] = attn.logit_max
        if dist_ready() and dist.get_world_size() > 1:
            with self.watch.blocked_in("the QK-clip logit-max all-reduce", "dp_comm"):
                dist.all_reduce(self.table, op=dist.ReduceOp.MAX)
        over = self.table > self.tau
        self.clipped = over.sum()
        eta = torch.where(over, self.tau / self.table, torch.ones_like(self.table))
        key_eta = eta.view(eta.size(0), -1, self.per_kv_head).amin(-1)  # [layers, kv heads]: the worst query head
        for i, attn in self.attentions.items():
            rows = scale_latent_rows if isinstance(attn, LatentAttention) else scale_rows
            rows(attn, eta[i, attn.head_ids], key_eta[i, attn.kv_head_ids])

    def shared(self, values: torch.Tensor, shares: int) -> None:
        pass

    def record(self) -> dict[str, Any]:
        # float64 as the other figures (Lightning averages what it is given over an epoch)
        return {"qk_clipped_heads": self.clipped.to(torch.float64).cpu() if self.clipped is not None else None}

    def after_step(self) -> None:
        pass


def scale_rows(attn: nn.Module, query: torch.Tensor, key: torch.Tensor) -> None:
    """Set the factors of the QKV weight's (and bias's) local rows, laid out [group][its queries, k, v][head_dim]
    (`ParallelAttention`), from η of `query` [this rank's query heads] and of `key` [its key/value heads]: √η each."""
    qkv, d = attn.qkv, attn.head_dim
    factors = torch.ones(attn.groups, attn.per_group + 2, d, dtype=query.dtype, device=query.device)
    factors[:, :attn.per_group] = query.sqrt().view(attn.groups, attn.per_group, 1)
    factors[:, attn.per_group] = key.sqrt()[:, None]
    _set(qkv, factors)


def scale_latent_rows(attn: nn.Module, query: torch.Tensor, key: torch.Tensor) -> None:
    """Latent attention's rows (module doc), from η of this rank's heads (`query`; `key` the same, one key per head):
    q_up's (or q's) [head][nope | rope] rows √η and η, kv_up's [head][k_nope | v] rows √η and 1."""
    w = attn.shape
    q = torch.ones(attn.heads, w.nope + w.rope, dtype=query.dtype, device=query.device)
    q[:, :w.nope], q[:, w.nope:] = query.sqrt()[:, None], query[:, None]
    kv = torch.ones(attn.heads, w.nope + w.v, dtype=key.dtype, device=key.device)
    kv[:, :w.nope] = key.sqrt()[:, None]
    _set(attn.q_up if w.q_rank else attn.q, q)
    _set(attn.kv_up, kv)


def _set(linear: nn.Module, factors: torch.Tensor) -> None:
    """The factor of each of the linear's local output rows, on its weight and bias (the optimizer applies them)."""
    for p in (linear.weight, linear.bias):
        if p is not None:
            p.qk_clip_scale = factors.reshape(-1)
