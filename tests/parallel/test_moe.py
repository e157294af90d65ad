"""Mixture of experts under tensor (with and without sequence parallelism), pipeline (1F1B at p = 4, m = 1 and
m >> p; ZB-H1 with full recomputation and the fused kernels; ZBV) and data parallelism (with the distributed
optimizer and optimizer post-validation): per-step losses, balancing losses, expert loads, gradient norms and the
parameters after three AdamW steps equal one process's in float64 (mlplat.model.moe, docs/moe.md). The CLI runs
ep2·tp2·sp·pp2(v2)·dp2 with the distributed optimizer on model=moe_tiny (tests/cli/test_train.py).

Expert parallelism (parallel.ep: whole experts split over the ranks of a stage, tokens dispatched by all-to-all,
all-gather, or all-to-all once per node then within it) under tp (folded, with and without sequence parallelism),
cp, dp with the distributed optimizer, ZBV and post-validation, the same way.

One spawned world of 4 ranks runs every layout in turn; the references run in the pytest process. The layouts
cover the router's options between them: softmax with top-k renormalisation and shared experts behind a gate,
sigmoid routing limited to the best group with aux-loss-free balancing (its bias moved by counts summed over the
ranks routing tokens of their own), both with the micro-batch's and the sequence-wise balancing losses, and
capacity dispatch (on layouts where a rank routes whole micro-batches, so the same tokens drop).

The overlapped schedule (1f1b_overlap) runs in the same world against 1f1b: bit-identical losses and gradients
under ep2·pp2 and ep4·d4 at m = 1, p and 4p, its hand-overs in the order the transport model checks.
"""
from __future__ import annotations

import pytest
import torch

from mlplat.specs import dispatchers
from tests.helpers import equivalence as eq
from tests.helpers.dist import run_distributed
from tests.helpers.kernels import eager_fused
from tests.helpers.moe import TOY

TOL = 1e-9
STEPS = 3
MICRO = 2

SOFTMAX = dict(num_experts=4, top_k=2, ffn_hidden=16, dense_layers=1, norm_topk_prob=True, shared_experts=1,
               shared_gate=True, aux_loss_coeff=0.05, seq_aux_loss_coeff=0.02, z_loss_coeff=0.01)
# DeepSeek-V3's: sigmoid scores, the k chosen among the experts of the best of two groups, renormalised and scaled
# (routed_scaling_factor), the expert bias, the sequence-wise balancing loss beside the micro-batch's.
SIGMOID = dict(num_experts=4, top_k=2, ffn_hidden=16, router="sigmoid", n_groups=2, topk_groups=1,
               norm_topk_prob=True, routed_scaling_factor=2.5, aux_loss_coeff=0.05, seq_aux_loss_coeff=0.02,
               bias_update_rate=0.01)
CAPACITY = dict(SOFTMAX, capacity_factor=1.0, shared_experts=0, shared_gate=False)
# Qwen3-MoE's attention: heads wider than hidden/heads (model.head_dim: a·d = 48 at h = 32), q and k norms over d.
QWEN3 = dict(arch="llama", n_kv_heads=2, qk_norm=True, head_dim=12)
# GLM-4.5's: Qwen3's with q/k/v biases and the rotation on the first half of each head (model.rotary_dim); its
# routing: sigmoid scores among the best groups, renormalised and scaled, an ungated shared expert
GLM = dict(QWEN3, qkv_bias=True, rotary_dim=6)

# name -> (layout, moe keys, global batch)
JOBS = {
    # Post-validated too: the balancing loss travels with the loss's asynchronous all-reduce.
    "tp2-sp-dp2-distributed-post-validate-capacity": (dict(tp=2, dp=2, sequence_parallel=True, distributed=True,
                                                           post_validate=True), CAPACITY, 8),
    # Zero bubble (the weight GEMMs of the shared parts deferred to W), full recomputation, the fused kernels.
    "tp2-pp2-zb_h1-full-recompute-fused-sigmoid-bias": (dict(tp=2, pp=2, schedule="zb_h1", recompute="full",
                                                             fused=True), SIGMOID, 8),
    # The first stage holds dense layers only (and takes part in the balancing loss's all-reduce all the same).
    "pp4-1f1b-m1-dense-first-stage": (dict(pp=4), dict(SOFTMAX, dense_layers=2), MICRO),
    "pp4-1f1b-m8": (dict(pp=4), SOFTMAX, 8 * MICRO),
    # Expert parallelism (whole experts, E/ep per rank, each rank routing its own tokens): the all-gather
    # dispatcher with capacity (a tp = c = 1 layout keeps each micro-batch's token set whole on one rank);
    # all-to-all with tp folded into ep (the ep group is the tp group) and sequence parallelism, the experts'
    # optimizer state sharded over their edp ranks (the dp group); ep across cp and tp without sequence
    # parallelism (each tp rank routes its half of the sequence), post-validated; ep beside ZBV's V with the expert
    # bias (its counts summed over the ep and edp groups), m = 4p.
    "ep4-dp4-allgather-capacity": (dict(dp=4, ep=4), dict(CAPACITY, dispatcher="allgather"), 8),
    "ep2-tp2-sp-dp2-distributed": (dict(tp=2, dp=2, ep=2, sequence_parallel=True, distributed=True), SOFTMAX, 8),
    "ep2-tp2-cp2-post-validate": (dict(tp=2, cp=2, ep=2, post_validate=True), SOFTMAX, 8),
    # the same layout with GLM-4.5's wide heads (Qwen3-MoE's, with biases and partial rotary): ring attention over
    # d = 12 at tp2, positions turning 6 of them; its routing
    "ep2-tp2-cp2-glm-heads": (dict(tp=2, cp=2, ep=2), dict(SIGMOID, bias_update_rate=0.0, expert_bias=True,
                                                           shared_experts=1), 8, GLM),
    # m = 8 = 4p through the V, the expert bias moved by counts summed over the ep and edp groups.
    "ep2-pp2v2-dp2-zbv-distributed-sigmoid-bias-m8": (dict(pp=2, vpp=2, dp=2, ep=2, schedule="zbv", distributed=True),
                                                      SIGMOID, 16 * MICRO),
    # The node dispatcher over two "nodes" of 2 ep ranks, DeepSeek-V3's routing limited to one group of two, each
    # group on one node (a token reaches one node; the other gets nothing of it), with capacity.
    "ep4-dp4-node_alltoall-2x2-groups-capacity": (dict(dp=4, ep=4, ep_per_node=2),
                                                  dict(SIGMOID, capacity_factor=1.0, dispatcher="node_alltoall"), 8),
    # A dispatcher written in a test file alone (tests/helpers/moe.py), registered for the run, with capacity.
    "ep4-dp4-toy-dispatcher": (dict(dp=4, ep=4), dict(CAPACITY, dispatcher=TOY.name), 8),
}


def _cfg(layout: dict, moe: dict, global_batch: int, model: dict | None = None):
    return eq.make_cfg(micro=MICRO, global_batch=global_batch, steps=STEPS, lr=1e-2, grad_clip=1.0,
                       model={"moe": moe, **(model or {})}, **layout)


def _worker(rank: int, world_size: int) -> dict:
    torch.set_num_threads(1)
    out = {}
    with eager_fused(), dispatchers.registered(TOY):
        for name, job in JOBS.items():
            cfg = _cfg(*job)
            out[name] = eq.train_run(cfg, eq.make_grid(cfg), STEPS)
            eq.barrier()
        out["generated"] = _generate(_cfg(*GENERATE))
        out["nodes"] = _node_layer_runs()
        out["collectives"] = _record_collectives()
        out["overlap"] = _overlap_runs()
    out["warmed"] = {ep: _warm_up(ep) for ep in (2, 4)}
    out["warmed nodes"] = _warm_up(4, ep_per_node=2)
    return out


def _warm_up(ep: int, ep_per_node: int | None = None) -> list:
    """The collectives a grid of ep·d4 posts when it is built (`create_communicators`, NCCL-strict mode on), each as
    (kind, elements, the group: "ep", the node sub-groups' "across" and "within", or None for another)."""
    import torch.distributed as dist

    from mlplat.harness import nccl_strict
    from mlplat.parallel.grid import ParallelGrid

    assert nccl_strict.enabled()
    log: list = []
    original = {n: getattr(dist, n) for n in ("all_reduce", "all_to_all_single")}

    def recording(name):
        def call(*args, **kwargs):
            log.append((name, args[0].numel(), kwargs.get("group")))
            return original[name](*args, **kwargs)
        return call

    try:
        for name in original:
            setattr(dist, name, recording(name))
        grid = ParallelGrid(dp=4, ep=ep, device=torch.device("cpu"), ep_per_node=ep_per_node)
    finally:
        for name, fn in original.items():
            setattr(dist, name, fn)
    nodes = {} if grid.ep_nodes is None else {id(grid.ep_nodes.across): "across", id(grid.ep_nodes.within): "within"}
    on = {id(grid.ep_group): "ep", **nodes}
    return [(name, n, on.get(id(group))) for name, n, group in log]


def _record_collectives() -> dict:
    """The collectives one MoE layer's forward and backward call, by kind, under ep4 (dispatch looks them up in
    torch.distributed at each call), and whether each ran on the ep group."""
    import torch.distributed as dist

    from mlplat.config import ModelConfig, MoEConfig
    from mlplat.model.moe import MoELayer
    from mlplat.parallel.grid import ParallelGrid

    grid = ParallelGrid(dp=4, ep=4, ep_per_node=2)
    on = {id(grid.ep_group): "ep", id(grid.ep_nodes.across): "across", id(grid.ep_nodes.within): "within"}
    names = [n for n in dir(dist) if any(k in n for k in ("all_to_all", "all_gather", "reduce_scatter", "all_reduce"))
             and callable(getattr(dist, n))]
    original = {n: getattr(dist, n) for n in names}
    log: list = []

    def recording(name):
        def call(*args, **kwargs):
            kind = next(k for k in ("all_to_all", "all_gather", "reduce_scatter", "all_reduce") if k in name)
            log.append((kind, on.get(id(kwargs.get("group")))))
            return original[name](*args, **kwargs)
        return call

    out = {}
    try:
        for name in names:
            setattr(dist, name, recording(name))
        for dispatcher in dispatchers.names():
            moe = MoEConfig(num_experts=4, top_k=2, ffn_hidden=16, dispatcher=dispatcher)
            layer = MoELayer(ModelConfig(arch="llama", hidden=32, n_heads=4, moe=moe), grid)
            layer.train()
            x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(dist.get_rank()), requires_grad=True)
            y = layer(x)
            forward = list(log)
            log.clear()
            y.square().sum().backward()
            out[dispatcher] = {"forward": forward, "backward": list(log)}
            log.clear()
    finally:
        for name, fn in original.items():
            setattr(dist, name, fn)
    return out


def test_the_dispatch_posts_the_collectives_the_transport_model_runs(world):
    """Each registered dispatcher's collectives (`mlplat.specs.dispatchers`), which the transport model posts
    beside the pipeline's transfers, are what a layer's forward and backward call, in order and kind, each on the
    ep group or the node sub-group its entry names (`over`), on every rank; the test's toy dispatcher included."""
    with dispatchers.registered(TOY):
        assert set(world[0]["collectives"]) == set(dispatchers.names()) >= {"alltoall", "allgather", "node_alltoall",
                                                                            TOY.name}
        for name in dispatchers.names():
            for phase in ("forward", "backward"):
                want = [(c.kind, c.over) for c in getattr(dispatchers.get(name), phase)]
                assert [r["collectives"][name][phase] for r in world] == [want] * 4, (name, phase)


def test_the_grid_warms_the_ep_group_with_an_all_to_all(world):
    """Built under ep2 within d4 and ep4 over it, in NCCL-strict mode, the grid posts one all-to-all of one element
    per rank on the ep group, after the all-reduce of every group (the ep group's own at ep2, the data-parallel one
    at ep4) and before the first step: NCCL's pair connections of the token dispatch made there; with the node
    dispatcher's sub-groups, theirs too."""
    for ep in (2, 4):
        posted = [r["warmed"][ep] for r in world]
        assert posted[0][-1] == ("all_to_all_single", ep, "ep") and all(p == posted[0] for p in posted), posted
        assert [kind for kind, *_ in posted[0]].count("all_to_all_single") == 1
        assert any(on == "ep" for kind, _, on in posted[0] if kind == "all_reduce"), posted[0]
    # the node dispatcher's sub-groups (ep4 as 2 nodes × 2): an all-reduce each, then an all-to-all each after the ep
    # group's, across the nodes first
    posted = [r["warmed nodes"] for r in world]
    assert all(p == posted[0] for p in posted)
    assert posted[0][-3:] == [("all_to_all_single", 4, "ep"), ("all_to_all_single", 2, "across"),
                              ("all_to_all_single", 2, "within")], posted[0]
    assert {on for kind, _, on in posted[0] if kind == "all_reduce"} >= {"across", "within"}


# The node dispatcher's layer against alltoall's, same weights and tokens, ep4 as two nodes of 2: name -> the moe
# keys. Beside the training run above (JOBS), the routings it meets: none limited; mla_tiny's (8 experts in 4
# groups, a token's from its best 2: a node holds 2 groups); one group of 2 (each token on one node) under capacity;
# most assignments dropped (c = 0.5 at k = 3: tokens with nothing kept send nothing).
NODE_LAYERS = {
    "dropless": dict(num_experts=8, top_k=2),
    "mla_tiny-groups": dict(num_experts=8, top_k=2, router="sigmoid", n_groups=4, topk_groups=2, norm_topk_prob=True,
                            routed_scaling_factor=2.5),
    "one-group-capacity": dict(num_experts=8, top_k=2, router="sigmoid", n_groups=2, topk_groups=1,
                               capacity_factor=1.0),
    "capacity-drops": dict(num_experts=8, top_k=3, capacity_factor=0.5),
}


def _node_layer_runs() -> dict:
    """Per case and dispatcher: the layer's output, the tokens' and every parameter's gradient of a loss on it, the
    routed and kept counts, and the token rows this rank sends to the other node."""
    from mlplat.config import ModelConfig, MoEConfig
    from mlplat.model.moe import MoELayer
    from mlplat.parallel.grid import ParallelGrid

    grid = ParallelGrid(dp=4, ep=4, ep_per_node=2)
    out = {}
    for case, keys in NODE_LAYERS.items():
        for dispatcher in ("alltoall", "node_alltoall"):
            moe = MoEConfig(ffn_hidden=16, dispatcher=dispatcher, **keys)
            layer = MoELayer(ModelConfig(arch="llama", hidden=32, n_heads=4, moe=moe), grid, dtype=torch.float64)
            for i, p in enumerate(layer.parameters()):
                torch.nn.init.normal_(p, std=0.3, generator=torch.Generator().manual_seed(i))
            layer.train()
            sent = []
            dispatch = layer.dispatcher.dispatch
            layer.dispatcher.dispatch = lambda *a, dispatch=dispatch: sent.append(dispatch(*a)) or sent[-1]
            x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(grid.rank), dtype=torch.float64,
                            requires_grad=True)
            y = layer(x)
            y.square().mean().backward()
            handle, other = sent[0].handle, 1 - grid.ep_rank // 2
            crossing = (sum(handle[1][2 * other:2 * other + 2]) if dispatcher == "alltoall" else handle[8][other])
            out[case, dispatcher] = {"y": y.detach(), "grads": {"x": x.grad, **{n: p.grad for n, p in
                                                                                  layer.named_parameters()}},
                                     "counts": layer.load_counts, "crossing": crossing}
    return out


@pytest.mark.parametrize("case", list(NODE_LAYERS))
def test_node_dispatcher_equals_alltoall(world, case):
    """node_alltoall against alltoall (itself equal to one process) on one MoE layer under ep4 as 2 nodes × 2, float64:
    the output and every gradient (tokens, router, experts) within 1e-12 of their largest value (the combine sums per
    rank, then per node, then per token, alltoall per token alone: another order of the same float64 sums), the
    routed and kept counts equal; no more token rows cross the nodes than alltoall's, fewer where a token's experts
    share a node."""
    plain, crossing = 0, 0
    for res in world:
        a, b = res["nodes"][case, "alltoall"], res["nodes"][case, "node_alltoall"]
        for key, want in [("y", a["y"]), *((f"grad {n}", g) for n, g in a["grads"].items())]:
            got = b["y"] if key == "y" else b["grads"][key[5:]]
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12 * max(1.0, float(want.abs().max())),
                                       msg=lambda m, key=key: f"{case} {key}: {m}")
        assert torch.equal(a["counts"], b["counts"]), case
        plain, crossing = plain + a["crossing"], crossing + b["crossing"]
    assert 0 < crossing < plain or case == "capacity-drops" and crossing <= plain, (case, crossing, plain)


# The overlapped schedule against its plain counterpart: name -> (layout, the m run), p = pp; 4 layers, the first
# dense, so that at ep2·pp2 stage 0 holds one MoE layer and stage 1 two.
# The node dispatcher's hand-overs too (ep4 as two nodes of 2), at m = 4.
OVERLAP = {"ep2-pp2": (dict(pp=2, dp=2, ep=2), (1, 2, 8)), "ep4-dp4": (dict(dp=4, ep=4), (1, 4)),
           "ep4-2x2-dp4-node_alltoall": (dict(dp=4, ep=4, ep_per_node=2), (4,))}


def _overlap_dispatcher(layout: dict) -> str:
    return "node_alltoall" if "ep_per_node" in layout else "alltoall"


def _overlap_runs() -> dict:
    """One forward_backward under 1f1b and under 1f1b_overlap per layout and m: loss, gradient norm, every full
    gradient, and the sides of the overlapped pass's hand-overs in order."""
    out = {}
    for name, (layout, ms) in OVERLAP.items():
        grid = None  # one grid per layout: its groups do not depend on the schedule or m
        for m in ms:
            for kind in ("1f1b", "1f1b_overlap"):
                cfg = eq.make_cfg(micro=1, global_batch=m * layout["dp"], steps=1, schedule=kind,
                                  model={"moe": dict(SOFTMAX, dispatcher=_overlap_dispatcher(layout)),
                                         "n_layers": 4}, **layout)
                grid = grid or eq.make_grid(cfg)
                module = eq.build_module(cfg, grid)
                module.engine.alternation.posts = []
                loss, norm = module.forward_backward(eq.local_batches(cfg, grid.dp_rank, 1)[0])
                out[name, m, kind] = {"loss": float(loss), "norm": float(norm),
                                      "grads": eq.full_tensors(module, grid, "grad")[0],
                                      "posts": module.engine.alternation.posts, "stage": grid.pp_rank}
    return out


@pytest.mark.parametrize("case", [(name, m) for name, (_, ms) in OVERLAP.items() for m in ms])
def test_overlapped_schedule_is_bit_identical_to_1f1b(world, case):
    """1f1b_overlap (each steady-state forward run with an earlier micro-batch's backward, handing over at each
    all-to-all) against 1f1b under ep2·pp2 and ep4·dp4 at m = 1, p and 4p, and the node dispatcher's ep4·dp4 as two
    nodes of 2 at m = 4: the loss, the gradient norm and every
    gradient equal bit for bit (the same graph, walked in the same order); the hand-overs alternate as the transport
    model runs them (`exchange.paired_collectives`), one pair after another."""
    from mlplat.parallel.layout.exchange import paired_collectives
    from mlplat.parallel.layout.schedules import rank_schedule

    name, m = case
    layout, _ = OVERLAP[name]
    p = layout.get("pp", 1)
    entry = dispatchers.get(_overlap_dispatcher(layout))
    forward, backward = (tuple(w for w, _ in entry.collectives(phase)) for phase in ("forward", "backward"))
    for rank, res in enumerate(world):
        plain, over = res["overlap"][name, m, "1f1b"], res["overlap"][name, m, "1f1b_overlap"]
        assert over["loss"] == plain["loss"] and over["norm"] == plain["norm"], (name, m, rank)
        assert over["grads"].keys() == plain["grads"].keys()
        for key, grad in plain["grads"].items():
            assert torch.equal(over["grads"][key], grad), (name, m, rank, key)
        stage = over["stage"]
        pairs = sum(i.paired for i in rank_schedule("1f1b_overlap", p, 1, m, stage))
        layers = 1 if (p == 2 and stage == 0) else (3 if p == 1 else 2)
        model = [side for what, side, _ in paired_collectives(forward * layers, backward * layers, True)
                 if what == "post"]
        assert over["posts"] == model * pairs, (name, m, rank)
        assert plain["posts"] == []
    assert any(r["overlap"][name, m, "1f1b_overlap"]["posts"] for r in world) == (m > 1)


# Greedy decoding under ep4·d4: the experts' dispatch spans the data-parallel replicas, so every replica decodes.
GENERATE = (dict(dp=4, ep=4), SOFTMAX, 8)
PROMPT, NEW_TOKENS = [5, 17, 42], 4


def _generate(cfg) -> list[int]:
    from mlplat.step.decode import generate

    return generate(eq.build_module(cfg, eq.make_grid(cfg)), PROMPT, NEW_TOKENS)


def test_greedy_decoding_under_expert_parallelism_equals_one_process(world):
    expected = _generate(_cfg({}, *GENERATE[1:]))
    assert len(expected) == len(PROMPT) + NEW_TOKENS
    assert [r["generated"] for r in world] == [expected] * 4


@pytest.fixture(scope="module")
def world() -> list[dict]:
    return run_distributed(_worker, 4, timeout=300)


@pytest.mark.parametrize("name", list(JOBS))
def test_moe_layout_equals_one_process(world, name):
    layout, moe, global_batch, *model = JOBS[name]
    with dispatchers.registered(TOY):  # one process has no ep group: its layers only permute
        cfg = _cfg({}, moe, global_batch, *model)
        ref = eq.train_run(cfg, eq.make_grid(cfg), STEPS)
    assert all(a is not None and a > 0 for a in ref["aux"]), ref["aux"]
    assert all(step["moe_load_max"] > 1 > step["moe_load_min"] for step in ref["loads"]), ref["loads"]
    for res in (r[name] for r in world):
        for key in ("losses", "aux", "norms"):
            torch.testing.assert_close(torch.tensor(res[key], dtype=torch.float64),
                                       torch.tensor(ref[key], dtype=torch.float64), rtol=0, atol=TOL,
                                       msg=lambda m, key=key: f"{name} {key}: {m}")
        # Every rank logs every layer's expert loads over the global batch, whichever stage and replica it is.
        for got, want in zip(res["loads"], ref["loads"], strict=True):
            assert got.keys() == want.keys() and all(abs(got[k] - want[k]) <= TOL for k in want), (name, got, want)
    merged = eq.merge([r[name] for r in world], "params")
    assert set(merged) == set(ref["params"])
    assert any(".mlp.experts.fc1." in n for n in merged) and any(".mlp.router." in n for n in merged)
    for full, copies in merged.items():
        for t in copies:
            torch.testing.assert_close(t, ref["params"][full], rtol=0, atol=TOL, msg=lambda m, n=full: f"{n}: {m}")
