"""Multi-token prediction (mlplat.model.mtp): the k-ahead targets, and the objective against a hand computation of
DeepSeek-V3's modules in one process."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mlplat.data.packing import PackedWindows, documents_of
from mlplat.labels import IGNORE
from mlplat.model.mtp import depth_targets
from mlplat.parallel.grid import ParallelGrid
from tests.helpers import equivalence as eq

X = IGNORE


def test_depth_targets_shift_k_ahead_and_ignore_past_the_end():
    labels = torch.tensor([[11, 12, 13, 14, 15]])  # the window's tokens 10..15: labels[i] = token i+1
    (in1, t1), (in2, t2) = depth_targets(labels, 2)
    assert in1.tolist() == [[11, 12, 13, 14, 15]] and t1.tolist() == [[12, 13, 14, 15, X]]
    assert in2.tolist() == [[12, 13, 14, 15, 0]] and t2.tolist() == [[13, 14, 15, X, X]]
    assert all(t.eq(X).all() for _, t in depth_targets(labels, 6)[4:])  # deeper than the window: nothing counts


def test_depth_targets_never_cross_a_document_boundary():
    """Packed documents (eod = 0): the labels at end-of-document tokens are IGNORE; a depth-k target counts only
    where token i and token i+k+1 are in the same document, and the input token i+k is then known."""
    window = torch.tensor([5, 6, 7, 0, 8, 9, 1, 2, 0, 3])
    x, y, _ = PackedWindows([(window[:-1], window[1:])], eod=0)[0]
    assert y.tolist() == [6, 7, 0, X, 9, 1, 2, 0, X]
    docs = documents_of(window, 0)  # every token's document, the window's last one (a label only) too
    targets = depth_targets(y[None], 3)
    for k, (inputs, target) in enumerate(targets, 1):
        for i in range(len(x)):
            j = i + k + 1  # the target's position in the window
            counted = target[0, i].item() != X
            assert counted == (j < len(window) and bool(docs[i] == docs[j])), (k, i)
            if counted:
                assert target[0, i] == window[j] and inputs[0, i] == window[i + k]
    assert targets[0][1].tolist() == [[7, 0, X, X, 1, 2, 0, X, X]]


def _hand(chunk, tokens, window, depth, coeff):
    """main + λ/D Σ_k L_k computed from the chunk's weights without its code path: module k on the first s-k
    positions only (causal: the same outputs there), its input embedding the window's tokens k ahead."""
    s, vocab = tokens.size(1), eq.VOCAB
    x = chunk.embedding.word.weight[tokens]
    if chunk.learned_positions:
        x = x + chunk.embedding.position.weight[:s]
    for layer in chunk.layers.values():
        x = layer(x)
    weight = chunk.output_embedding()

    def ce(h, norm, targets):
        return F.cross_entropy(F.linear(norm(h), weight)[..., :vocab].flatten(0, 1), targets.flatten())

    main = ce(x, chunk.final_ln, window[:, 1:])
    losses = []
    h = x
    for k, module in enumerate(chunk.mtp, 1):
        emb = chunk.embedding.word.weight[window[:, k:s]]
        h = module.layer(module.proj(torch.cat([module.enorm(emb), module.hnorm(h[:, :s - k])], -1)))
        losses.append(ce(h, module.norm, window[:, k + 1:]))
    return main, torch.stack(losses), main + coeff / depth * sum(losses)


@pytest.mark.parametrize("model", [dict(mtp=dict(depth=2, loss_coeff=0.5)),  # GPT: tied, learned positions
                                   dict(arch="llama", mtp=dict(depth=1, loss_coeff=0.3))])  # untied, rotary
def test_objective_is_main_plus_coeff_over_depth_times_the_sum(model):
    """The chunk's loss is the language-model loss, its gradient that of main + λ/D Σ_k L_k; the depths' losses it
    keeps are the L_k (all by hand: `_hand`)."""
    cfg = eq.make_cfg(model=model, global_batch=2)
    depth, coeff = cfg.model.mtp.depth, cfg.model.mtp.loss_coeff
    chunk = eq.build_module(cfg, ParallelGrid()).chunks[0]
    window = eq.dataset(2)
    tokens, labels = window[:, :-1], window[:, 1:]
    params = [p for p in chunk.parameters()]
    loss = chunk(tokens, labels)
    got = torch.autograd.grad(loss, params)
    main, losses, objective = _hand(chunk, tokens, window, depth, coeff)
    want = torch.autograd.grad(objective, params, allow_unused=True)
    torch.testing.assert_close(loss, main, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(chunk.mtp.loss_sum, losses.detach(), rtol=1e-12, atol=1e-12)
    assert chunk.mtp.micro_batches == 1
    for (name, _), g, w in zip(chunk.named_parameters(), got, want):
        torch.testing.assert_close(g, w if w is not None else torch.zeros_like(g), rtol=1e-10, atol=1e-12,
                                   msg=lambda m: f"{name}: {m}")
    assert all(g.abs().sum() > 0 for (n, _), g in zip(chunk.named_parameters(), got) if n.startswith("mtp."))
    # Validation (eval mode, no gradient; no dropout here anyway): the same loss and depths' losses.
    chunk.eval()
    chunk.mtp.reset_stats()
    with torch.no_grad():
        torch.testing.assert_close(chunk(tokens, labels), main.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(chunk.mtp.loss_sum, losses.detach(), rtol=1e-12, atol=1e-12)


def test_a_modules_layer_is_layer_l_plus_k_minus_1_of_the_model():
    """The modules' layers are layers l + k - 1 of the model: with experts (from model.moe.dense_layers < l on) they
    hold experts, in a dense model a dense MLP."""
    from mlplat.model.decoder import build_rank_chunks
    from mlplat.model.moe import MoELayer
    from mlplat.parallel.layout.pipeline import PipelineLayout

    for moe, kinds in ((dict(num_experts=4, top_k=2, dense_layers=3), [True, True]), (None, [False, False])):
        cfg = eq.make_cfg(model=dict(arch="llama", n_layers=4, mtp=dict(depth=2), **({"moe": moe} if moe else {})))
        chunk = build_rank_chunks(cfg.model, ParallelGrid(), PipelineLayout(1), device=torch.device("meta"))[0]
        assert [isinstance(m.layer.mlp, MoELayer) for m in chunk.mtp] == kinds
