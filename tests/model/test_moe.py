"""The MoE layer in one process (mlplat.model.moe): the grouped GEMM against one GEMM per expert, the whole layer's
grouped path (float32) against its per-expert path (float64), the routers' gates, group-limited routing, the
balancing losses' values (the sequence loss against a direct computation, values and gradients), their slices adding
up, the capacity drop policy, the balancing loss's gradient entering backward at the layer, the expert bias's step,
the logged load figures, and the group and sequence keys' refusals."""
from __future__ import annotations

import pytest
import torch

from mlplat.config import ConfigError, ModelConfig, MoEConfig, load_config
from mlplat.model.moe import (
    MoELayer,
    balance_loss,
    expert_counts,
    group_limited_topk,
    load_figures,
    step_loads,
    update_biases,
)
from mlplat.parallel.grid import ParallelGrid
from mlplat.parallel.linear import grouped_mm
from mlplat.specs import routers


def _layer(dtype=torch.float64, num_experts=4, **moe) -> MoELayer:
    keys = dict(num_experts=num_experts, top_k=2, ffn_hidden=16, aux_loss_coeff=0.1, z_loss_coeff=0.01)
    cfg = ModelConfig(arch="llama", mlp="swiglu", hidden=32, n_heads=4, moe=MoEConfig(**{**keys, **moe}))
    gen = torch.Generator().manual_seed(0)
    layer = MoELayer(cfg, ParallelGrid(), dtype=dtype)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.3)
    return layer


def test_grouped_gemm_equals_one_gemm_per_expert_in_float32():
    gen = torch.Generator().manual_seed(1)
    counts = torch.tensor([3, 0, 5, 1])  # an expert without tokens too
    x = torch.randn(9, 16, generator=gen)
    w = torch.randn(4, 16, 8, generator=gen)
    grad = torch.randn(9, 8, generator=gen)
    outs = []
    for path in ("grouped", "loop"):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = grouped_mm(xi, wi, counts, path)
        y.backward(grad)
        outs.append((y.detach(), xi.grad, wi.grad))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert float(outs[0][2][1].abs().max()) == 0.0  # no tokens, no gradient


def test_layer_grouped_float32_equals_per_expert_float64(monkeypatch):
    """The same weights and tokens: float32 runs torch._grouped_mm (widths aligned), float64 one GEMM per expert."""
    calls = []
    grouped = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(a[0].dtype) or grouped(*a, **k))
    ref = _layer(torch.float64)
    f32 = _layer(torch.float32)
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    outs = []
    for layer, dtype in ((ref, torch.float64), (f32, torch.float32)):
        layer.train()
        xi = x.detach().to(dtype).requires_grad_()
        layer(xi).square().sum().backward()
        outs.append((xi.grad, layer.experts.fc1.weight.grad, layer.router.weight.grad, layer.aux_sum))
    assert calls == [torch.float32] * 2  # fc1 and fc2 of the float32 layer only
    for a, b in zip(*outs):
        b, a = (torch.as_tensor(v, dtype=torch.float64) for v in (b, a))
        torch.testing.assert_close(b, a, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("mlp,approximate,norm", [("swiglu", "none", True), ("swiglu", "none", False),
                                                   ("gelu", "none", False), ("gelu", "tanh", True)])
def test_the_layer_equals_gates_times_expert_outputs(mlp, approximate, norm):
    """The experts weigh fc2's input by the gate and keep fc1's output alone (`_WeightedActivation`, its backward
    written by hand), the router keeps its input in its own dtype (`_RouterLinear`); in float64 the output and every
    gradient equal the textbook form, Σ over a token's k experts of gate · expert(x), written token by token with
    autograd's own operators, for SwiGLU and both GeLUs."""
    fn = torch.nn.functional
    moe = MoEConfig(num_experts=4, top_k=2, ffn_hidden=16, norm_topk_prob=norm)
    layer = MoELayer(ModelConfig(arch="llama", mlp=mlp, hidden=32, n_heads=4, moe=moe), ParallelGrid(),
                     dtype=torch.float64, approximate=approximate)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.3)
    layer.train()
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(5), dtype=torch.float64, requires_grad=True)
    weight = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    params = [layer.router.weight, layer.experts.fc1.weight, layer.experts.fc2.weight]
    y = layer(x)
    got = (y, *torch.autograd.grad((y * weight).sum(), [x, *params]))

    xs = x.detach().requires_grad_()
    wr, w1, w2 = (p.detach().requires_grad_() for p in params)
    probs = (xs.reshape(-1, 32) @ wr.t()).softmax(-1)
    gates, chosen = probs.topk(2, dim=-1)
    if norm:
        gates = gates / gates.sum(-1, keepdim=True)
    fc1 = w1.view(4, -1, 32)  # [E, 2f, h] (gate rows, then up rows) or [E, f, h]
    fc2 = w2.view(4, 32, 16)  # [E, h, f]
    rows = []
    for t, token in enumerate(xs.reshape(-1, 32)):
        out = token.new_zeros(32)
        for j in range(2):
            e = int(chosen[t, j])
            if mlp == "swiglu":
                gate, up = (fc1[e] @ token).chunk(2)
                act = fn.silu(gate) * up
            else:
                act = fn.gelu(fc1[e] @ token, approximate=approximate)
            out = out + gates[t, j] * (fc2[e] @ act)
        rows.append(out)
    ref = torch.stack(rows).view(2, 8, 32)
    want = (ref, *torch.autograd.grad((ref * weight).sum(), [xs, wr, w1, w2]))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_the_router_keeps_a_bf16_input_and_differentiates_as_in_float32():
    """`_RouterLinear` on bf16 tokens: logits and gradients bit-equal to autograd through the float32 copy it no
    longer keeps."""
    from mlplat.model.moe import _RouterLinear

    gen = torch.Generator().manual_seed(7)
    x = torch.randn(16, 32, generator=gen).to(torch.bfloat16).requires_grad_()
    w = torch.randn(4, 32, generator=gen).to(torch.bfloat16).requires_grad_()
    g = torch.randn(16, 4, generator=gen)
    mine = _RouterLinear.apply(x, w, torch.float32)
    plain = torch.nn.functional.linear(x.float(), w.float())
    assert torch.equal(mine, plain)
    for a, b in zip(torch.autograd.grad(mine, [x, w], g), torch.autograd.grad(plain, [x, w], g)):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)


@pytest.mark.parametrize("router,norm,scale", [("softmax", True, 1.0), ("softmax", False, 1.0),
                                               ("sigmoid", True, 2.5), ("sigmoid", False, 1.0),
                                               ("sigmoid", False, 2.5)])
def test_gates(router, norm, scale):
    """The k chosen scores, renormalised to sum 1 where norm_topk_prob says (under either router), then times
    routed_scaling_factor (DeepSeek-V3's 2.5)."""
    layer = _layer(router=router, norm_topk_prob=norm, routed_scaling_factor=scale)
    x = torch.randn(10, 32, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    chosen, gates, probs, logits = layer.route(x)
    scores = logits.softmax(-1) if router == "softmax" else logits.sigmoid()
    assert torch.equal(chosen, scores.topk(2, dim=-1).indices)
    expected = scores.gather(1, chosen)
    if norm:
        expected = expected / expected.sum(-1, keepdim=True)
    torch.testing.assert_close(gates, expected * scale)
    torch.testing.assert_close(probs.sum(-1), torch.ones(10, dtype=torch.float64))


def test_balancing_loss_is_one_balanced_and_e_collapsed():
    layer = _layer(aux_loss_coeff=1.0, z_loss_coeff=0.0, top_k=1)
    n, e = 8, 4
    balanced = torch.arange(n).remainder(e).unsqueeze(1)
    uniform = torch.full((n, e), 1 / e, dtype=torch.float64)
    assert float(layer.balancing_loss(balanced, uniform, uniform.log(), batch=1)) == pytest.approx(1.0)
    collapsed = torch.zeros(n, 1, dtype=torch.long)
    one_hot = torch.nn.functional.one_hot(collapsed[:, 0], e).to(torch.float64)
    assert float(layer.balancing_loss(collapsed, one_hot, one_hot, batch=1)) == pytest.approx(e)
    z = _layer(aux_loss_coeff=0.0, z_loss_coeff=1.0)
    logits = torch.randn(n, e, dtype=torch.float64)
    torch.testing.assert_close(z.balancing_loss(collapsed, one_hot, logits, batch=1),
                               logits.logsumexp(-1).square().mean())


def _group_limited_by_hand(choice: torch.Tensor, k: int, n_groups: int, topk_groups: int, router: str):
    """Token by token: each group's score, the best groups, then the k largest of their experts (as index sets)."""
    out = []
    for row in choice.tolist():
        size = len(row) // n_groups
        groups = [row[g * size:(g + 1) * size] for g in range(n_groups)]
        scores = [sum(sorted(g)[-2:]) if router == "sigmoid" else max(g) for g in groups]
        best = sorted(range(n_groups), key=lambda g: -scores[g])[:topk_groups]
        eligible = [e for g in best for e in range(g * size, (g + 1) * size)]
        out.append(set(sorted(eligible, key=lambda e: -row[e])[:k]))
    return out


@pytest.mark.parametrize("router", ["sigmoid", "softmax"])
def test_group_limited_routing_chooses_only_in_the_best_groups(router):
    """8 experts in 4 groups of 2, the 2 best groups eligible (DeepSeek-V3's shape, scaled down): the layer's choice
    equals a token-by-token computation, lies in the tokens' best groups, and differs from the plain top-k (so the
    limit acts). With the expert bias, the groups are scored on the biased choice, as the experts are."""
    layer = _layer(num_experts=8, top_k=3, router=router, n_groups=4, topk_groups=2, bias_update_rate=0.1,
                   norm_topk_prob=router == "sigmoid")
    layer.expert_bias.copy_(torch.linspace(-0.2, 0.2, 8, dtype=torch.float64))
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    chosen, gates, probs, logits = layer.route(x)
    scores = logits.softmax(-1) if router == "softmax" else logits.sigmoid()
    torch.testing.assert_close(probs, scores / scores.sum(-1, keepdim=True))  # every expert's
    picked = scores.gather(1, chosen)
    torch.testing.assert_close(gates, picked / picked.sum(-1, keepdim=True) if router == "sigmoid" else picked)
    choice = scores + layer.expert_bias
    expected = _group_limited_by_hand(choice, 3, 4, 2, router)
    assert [set(row) for row in chosen.tolist()] == expected
    groups_used = [{e // 2 for e in row} for row in chosen.tolist()]
    assert all(len(g) <= 2 for g in groups_used) and any(len(g) == 2 for g in groups_used)
    plain = [set(row) for row in choice.topk(3, dim=-1).indices.tolist()]
    assert sum(a != b for a, b in zip(plain, expected)) >= 5, "the group limit changed no token's experts"
    # n_groups=1 is the plain top-k; one group per expert under sigmoid scores each by itself.
    assert torch.equal(group_limited_topk(choice, 3, 1, 1, routers.get(router).group_score),
                       choice.topk(3, dim=-1).indices)
    singles = group_limited_topk(choice, 3, 8, 3, routers.get("sigmoid").group_score)
    assert [set(r) for r in singles.tolist()] == plain


def _seq_aux_by_hand(chosen: torch.Tensor, probs: torch.Tensor, b: int, s: int, k: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss, written out: per sequence, f_e = E/(k·s)·(tokens choosing e) and
    P_e = the mean of p_e over its s tokens; Σₑ f_e·P_e; the mean over the b sequences."""
    e = probs.shape[1]
    losses = []
    for j in range(b):
        rows = range(j * s, (j + 1) * s)
        f = [e / (k * s) * sum(int(c == x) for t in rows for c in chosen[t].tolist()) for x in range(e)]
        p = [sum(probs[t, x] for t in rows) / s for x in range(e)]
        losses.append(sum(fx * px for fx, px in zip(f, p)))
    return sum(losses) / b


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_sequence_balance_loss_equals_a_direct_computation(router):
    """The layer's sequence loss (seq_aux_loss_coeff) on 3 sequences of 6 tokens in float64, against the loss written
    out: its value (logged in aux_sum) and its gradient, entering backward at the layer, to 1e-12. The micro-batch's
    loss (aux) on the same tokens is another number: the per-sequence sets are the ones used."""
    b, s = 3, 6
    layer = _layer(num_experts=8, top_k=2, router=router, shared_experts=0, aux_loss_coeff=0.0, z_loss_coeff=0.0,
                   seq_aux_loss_coeff=0.3, n_groups=2, topk_groups=1)
    x = torch.randn(b, s, 32, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    layer.train()
    layer(x).square().sum().backward()
    got = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()
    layer.eval()  # no injection: the loss written out is added by hand
    out = layer(x).square().sum()
    chosen, _, probs, _ = layer.route(x.reshape(-1, 32))
    by_hand = _seq_aux_by_hand(chosen, probs, b, s, 2)
    (out + 0.3 * by_hand).backward()
    assert float(layer.aux_sum) == pytest.approx(0.3 * float(by_hand.detach()), rel=1e-12, abs=0)
    assert float(got["router.weight"].abs().max()) > 0
    for n, p in layer.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-12, atol=1e-12)
    whole, by_hand = float(_seq_aux_by_hand(chosen, probs.detach(), 1, b * s, 2)), float(by_hand.detach())
    assert abs(whole - by_hand) > 1e-3, (whole, by_hand)  # one set, the micro-batch: another loss


def test_balance_losses_of_slices_add_up():
    """A caller that holds a slice of each token set (an expert-parallel rank) passes the counts summed over the
    slices and the sets' full token count: the slices' losses add up to the loss, values and gradients, for the
    micro-batch's one set and for its sequences."""
    gen = torch.Generator().manual_seed(8)
    n, e, k, s = 24, 6, 2, 8
    logits = torch.randn(n, e, generator=gen, dtype=torch.float64, requires_grad=True)
    chosen = logits.detach().topk(k, dim=-1).indices
    slices = [torch.arange(0, n, 3), torch.cat([torch.arange(1, n, 3), torch.arange(2, n, 3)])]  # uneven, mixed
    for set_tokens in (n, s):
        token_set = torch.arange(n) // set_tokens
        n_sets = n // set_tokens
        probs = logits.softmax(-1)
        full = balance_loss(probs, token_set, expert_counts(chosen, token_set, n_sets, e), set_tokens, k)
        (grad_full,) = torch.autograd.grad(full, logits)
        counts = sum(expert_counts(chosen[i], token_set[i], n_sets, e) for i in slices)  # the all-reduce
        probs = logits.softmax(-1)
        parts = sum(balance_loss(probs[i], token_set[i], counts, set_tokens, k) for i in slices)
        (grad_parts,) = torch.autograd.grad(parts, logits)
        torch.testing.assert_close(parts, full, rtol=1e-14, atol=0)
        torch.testing.assert_close(grad_parts, grad_full, rtol=1e-12, atol=1e-15)
        # Local counts (not summed over the slices) give another loss: the check can fail.
        local = sum(balance_loss(probs[i], token_set[i], expert_counts(chosen[i], token_set[i], n_sets, e),
                                 set_tokens, k) for i in slices)
        assert abs(float(local.detach()) - float(full.detach())) > 1e-3


MOE = dict(num_experts=8, top_k=2)


@pytest.mark.parametrize("moe,message", [
    (dict(MOE, n_groups=3), "model.moe.n_groups=3 must divide model.moe.num_experts=8"),
    (dict(MOE, n_groups=0), "model.moe.n_groups=0 must divide model.moe.num_experts=8"),
    (dict(MOE, n_groups=4, topk_groups=0), "model.moe.topk_groups=0 must be in [1, model.moe.n_groups=4]"),
    (dict(MOE, n_groups=4, topk_groups=5), "model.moe.topk_groups=5 must be in [1, model.moe.n_groups=4]"),
    (dict(MOE, top_k=3, n_groups=4, topk_groups=1), "model.moe.top_k=3 is more than the 2 experts of "
                                                    "model.moe.topk_groups=1 groups of 2"),
    (dict(MOE, seq_aux_loss_coeff=-0.1), "model.moe.seq_aux_loss_coeff=-0.1 must be non-negative"),
])
def test_group_and_sequence_keys_are_refused_in_one_line(moe, message):
    with pytest.raises(ConfigError) as info:
        load_config({"model": {"vocab_size": 256, "moe": moe}}, world_size=None, check_data=False)
    assert "\n" not in str(info.value) and message in str(info.value), str(info.value)


def test_capacity_keeps_each_experts_first_assignments_in_token_order():
    from mlplat.parallel.dispatch import permute

    chosen = torch.tensor([[2], [0], [2], [2], [1], [2]])  # capacity ceil(1.0 · 6 · 1 / 4) = 2
    gates = torch.arange(6, dtype=torch.float64).unsqueeze(1)
    token, gate, counts, assigned = vars(permute(chosen, gates, 4, capacity_factor=1.0)).values()
    assert token.tolist() == [1, 4, 0, 2] and counts.tolist() == [1, 1, 2, 0]  # tokens 3 and 5 dropped
    assert gate.tolist() == [1.0, 4.0, 0.0, 2.0] and assigned.tolist() == [1, 1, 4, 0]
    token, _, counts, assigned = vars(permute(chosen, gates, 4, capacity_factor=None)).values()  # dropless
    assert token.tolist() == [1, 4, 0, 2, 3, 5] and counts.tolist() == assigned.tolist() == [1, 1, 4, 0]


def test_balancing_loss_gradient_enters_at_the_layer():
    """Backward through the layer's output adds d(balancing loss)/dθ·scale: the same gradients as autograd on
    output loss + scale·balancing loss computed outside the layer."""
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    layer = _layer(shared_experts=0)
    layer.train()
    layer.aux_grad_scale = 0.5
    layer(x).square().sum().backward()
    got = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()
    layer.eval()  # no injection: the loss is added by hand
    out = layer(x).square().sum()
    chosen, _, probs, logits = layer.route(x.reshape(-1, 32))
    (out + 0.5 * layer.balancing_loss(chosen, probs, logits, batch=2)).backward()
    assert float(got["router.weight"].sub(layer.router.weight.grad).abs().max()) < 1e-12
    for n, p in layer.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-12, atol=1e-12)


def test_expert_bias_moves_towards_balance_and_only_chooses():
    layer = _layer(router="sigmoid", bias_update_rate=0.25, norm_topk_prob=True)
    layer.train()
    x = torch.randn(1, 16, 32, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    layer(x).sum().backward()
    counts = layer.load_counts[0].clone()  # assignments per expert
    update_biases([layer], ParallelGrid())
    torch.testing.assert_close(layer.expert_bias, 0.25 * torch.sign(counts.mean() - counts))
    chosen, gates, _, logits = layer.route(x.reshape(-1, 32))
    scores = logits.sigmoid()
    assert torch.equal(chosen, (scores + layer.expert_bias).topk(2, dim=-1).indices)
    torch.testing.assert_close(gates, scores.gather(1, chosen) / scores.gather(1, chosen).sum(-1, keepdim=True))


def test_load_figures_count_the_kept_and_dropped_assignments_of_the_step():
    """Two micro-batches under capacity: each expert's kept assignments as a share of their mean (least and most
    loaded) and the dropped fraction, from the routing recomputed by hand; the step's counts are summed once."""
    layer = _layer(top_k=1, capacity_factor=1.0)
    layer.train()
    xs = [torch.randn(1, 12, 32, generator=torch.Generator().manual_seed(s), dtype=torch.float64) for s in (6, 7)]
    assigned, kept = torch.zeros(4), torch.zeros(4)
    for x in xs:
        layer(x).sum().backward()
        chosen = layer.route(x.reshape(-1, 32))[0]
        n = torch.bincount(chosen.reshape(-1), minlength=4).double()
        assigned, kept = assigned + n, kept + n.clamp(max=3)  # capacity ceil(1.0 · 12 · 1 / 4) = 3
    step_loads([layer], ParallelGrid())
    step_loads([layer], ParallelGrid())  # once per step: a second call adds nothing
    torch.testing.assert_close(layer.loads, torch.stack([assigned, kept]).double())
    figures = load_figures([layer])[0].tolist()
    share = kept / kept.mean()
    assert figures == [float(share.min()), float(share.max()), float((assigned.sum() - kept.sum()) / 24)]
    assert figures[2] > 0 and figures[0] < 1 < figures[1]  # these tokens overflow an expert and leave one short


def test_a_mixture_of_experts_has_a_transformers_class_only_as_a_mixtral():
    """Export --format hf writes Mixtral's mixture of experts (tests/checkpoint/test_hf_mixtral.py) and refuses any
    other rather than writing a dense model without its experts."""
    from mlplat.checkpoint.hf_config import hf_class

    dense = ModelConfig(arch="llama", vocab_size=256)
    assert hf_class(dense) == ("llama", "LlamaForCausalLM")
    mixtral = MoEConfig(num_experts=4, norm_topk_prob=True)
    assert hf_class(ModelConfig(arch="llama", vocab_size=256, moe=mixtral)) == ("mixtral", "MixtralForCausalLM")
    assert hf_class(ModelConfig(arch="llama", vocab_size=256, moe=MoEConfig(num_experts=4))) is None


def test_the_expert_bias_stays_float64_when_the_weights_are_cast():
    layer = _layer(router="sigmoid", bias_update_rate=0.001).to(torch.bfloat16)
    assert layer.router.weight.dtype == torch.bfloat16 and layer.expert_bias.dtype == torch.float64
    layer.expert_bias += 0.001  # a step bf16 would round away at 1.0
    layer.expert_bias += 1.0
    assert float(layer.expert_bias[0]) == 1.001


class _Float32AsFloat64:
    """A stand-in for the `torch` of a transformers modeling module whose float32 is float64 (all else torch's): its
    own router code, computed in float64."""

    float32 = torch.float64

    def __getattr__(self, name):
        return getattr(torch, name)


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
@pytest.mark.parametrize("norm", [True, False])
def test_routing_equals_transformers_deepseek_v3_and_glm4_moe_routers(family, norm, monkeypatch):
    """DeepSeek-V3's and GLM-4.5's routers in transformers (DeepseekV3TopkRouter, Glm4MoeTopkRouter: sigmoid scores
    plus the correction bias, the best 2 of 4 groups by their two best, top-4, norm_topk_prob, routed_scaling_factor
    2.5) and MoELayer.route, the same router weight and bias, on 200 random tokens in float64: the same experts and
    the same gates to 1e-15. transformers' own forward runs, its float32 read as float64."""
    transformers = pytest.importorskip("transformers")
    import importlib

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    monkeypatch.setattr(module, "torch", _Float32AsFloat64())
    prefix = {"deepseek_v3": "DeepseekV3", "glm4_moe": "Glm4Moe"}[family]
    config_class, router_class = f"{prefix}Config", getattr(module, f"{prefix}TopkRouter")
    config = getattr(transformers, config_class)(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4,
                                                 n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                                 norm_topk_prob=norm)
    theirs = router_class(config).to(torch.float64)
    layer = _layer(num_experts=16, top_k=4, router="sigmoid", n_groups=4, topk_groups=2, norm_topk_prob=norm,
                   routed_scaling_factor=2.5, expert_bias=True)
    gen = torch.Generator().manual_seed(8)
    with torch.no_grad():
        theirs.weight.copy_(layer.router.weight)
        layer.expert_bias.copy_(0.3 * torch.randn(16, generator=gen, dtype=torch.float64))
        theirs.e_score_correction_bias.copy_(layer.expert_bias)
    x = torch.randn(200, 32, generator=gen, dtype=torch.float64)
    chosen, gates, _, logits = layer.route(x)
    their_logits, their_gates, their_chosen = theirs(x)
    assert their_gates.dtype == torch.float64 and torch.equal(logits, their_logits)
    order, their_order = chosen.sort(-1), their_chosen.sort(-1)  # theirs unsorted (topk sorted=False)
    assert torch.equal(order.values, their_order.values)
    torch.testing.assert_close(gates.gather(1, order.indices), their_gates.gather(1, their_order.indices),
                               rtol=1e-15, atol=1e-15)
    # the bias and the group limit act: plain top-4 of the scores would choose otherwise for many tokens
    plain = logits.sigmoid().topk(4, dim=-1).indices.sort(-1).values
    assert (plain != order.values).any(-1).sum() > 50
