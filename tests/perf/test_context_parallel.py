"""Context parallelism (parallel.cp = c) in the planning models: the memory model's 1/c activations and ring
buffers, the ring's exposed time, the data-parallel reduction over d·c, the planner's search of c and the dry run's
context line."""
from __future__ import annotations

from dataclasses import replace

import pytest

from mlplat.perf.cluster import cp_inter_node, predict, ring_times
from mlplat.perf.flops import ModelDims
from mlplat.perf.links import p2p_time
from mlplat.perf.memory import Layout, dkv_block_bytes, kv_block_bytes, layer_activation_bytes, memory_per_gpu
from tests.helpers.perf import a100

# Llama-shaped: grouped-query attention (8 KV heads of 32), RoPE, SwiGLU.
LLAMA = ModelDims(n_layers=16, hidden=4096, n_heads=32, seq_len=32768, vocab_size=128256, n_kv_heads=8,
                  ffn_hidden=14336, position="rope", norm="rmsnorm", mlp="swiglu", tie_embeddings=False, bias=False,
                  arch="llama")


@pytest.mark.parametrize("recompute,attention", [("none", "flash"), ("none", "unfused"), ("selective", "unfused"),
                                                 ("full", "flash")])
@pytest.mark.parametrize("sp", [False, True])
def test_activations_per_layer_are_one_cth_plus_the_ring_buffers(recompute, attention, sp):
    base = Layout(tp=2, pp=2, dp=1, global_batch_size=8, micro_batch_size=1, recompute=recompute, attention=attention,
                  sequence_parallel=sp, precision="bf16-megatron")
    one = memory_per_gpu(LLAMA, base)
    assert "ring_buffers" not in one.breakdown and kv_block_bytes(LLAMA, base) == 0
    for c in (2, 4):
        lay = replace(base, cp=c)
        assert layer_activation_bytes(LLAMA, lay) == pytest.approx(layer_activation_bytes(LLAMA, base) / c)
        mem = memory_per_gpu(LLAMA, lay)
        for key in ("activations", "working_set", "messages"):
            assert mem.breakdown[key] == pytest.approx(one.breakdown[key] / c), key
        # Two K/V and two dK/dV blocks, each 2·b·(s/c)·(k/t)·d elements: K/V in bf16, dK/dV in float32 (the ring
        # adds its partial sums unrounded, parallel/context.py)
        block = 2 * 2 * 1 * (LLAMA.seq_len // c) * (8 // 2) * 128
        assert kv_block_bytes(LLAMA, lay) == block and dkv_block_bytes(LLAMA, lay) == 2 * block
        assert mem.breakdown["ring_buffers"] == 2 * block + 2 * 2 * block
        assert dkv_block_bytes(LLAMA, replace(lay, precision="32-true")) == kv_block_bytes(LLAMA, replace(
            lay, precision="32-true"))
        # Weights replicated over c like data parallelism: the model state per GPU does not change.
        for key in ("weights", "gradients", "optimizer_state"):
            assert mem.breakdown[key] == one.breakdown[key], key


def test_distributed_optimizer_shards_over_d_times_c():
    lay = Layout(tp=2, pp=1, dp=2, cp=2, global_batch_size=8, distributed_optimizer=True, precision="bf16-megatron")
    as_dp = replace(lay, dp=4, cp=1)
    assert lay.replicas == as_dp.replicas == 4 and lay.gpus == as_dp.gpus == 8
    assert memory_per_gpu(LLAMA, lay).breakdown["optimizer_state"] == \
        memory_per_gpu(LLAMA, as_dp).breakdown["optimizer_state"]


def test_ring_time_counts_the_transfers_and_hides_behind_compute():
    cl = a100()
    lay = Layout(tp=2, pp=1, dp=1, cp=4, global_batch_size=1, recompute="none", precision="bf16-megatron")
    free = ring_times(LLAMA, lay, cl, 0.0, 0.0)
    x, y = free["cp_transfer"], free["cp_transfer_dkv"]
    kv, dkv = kv_block_bytes(LLAMA, lay), dkv_block_bytes(LLAMA, lay)
    assert (x, y) == (p2p_time(kv, cl, False), p2p_time(dkv, cl, False)) and dkv == 2 * kv  # dK/dV in float32
    # No compute to hide behind: c-1 K/V transfers forward; c-1 K/V with the dK/dV beside them, and the last
    # dK/dV home, backward.
    xy = p2p_time(kv + dkv, cl, False)
    assert free["cp_exposed_forward"] == pytest.approx(3 * x)
    assert free["cp_exposed_backward"] == pytest.approx(3 * xy + y)
    # Compute dominates: only the last dK/dV's return to its owner stays exposed.
    hidden = ring_times(LLAMA, lay, cl, 100 * x, 250 * x)
    assert hidden["cp_exposed_forward"] == 0.0 and hidden["cp_exposed_backward"] == pytest.approx(y)
    # A recomputed forward runs its ring again.
    full = ring_times(LLAMA, replace(lay, recompute="full"), cl, 0.0, 0.0)
    assert full["cp_exposed_backward"] == pytest.approx(3 * xy + y + 3 * x)
    # At c = 2 both directions of a hop share one peer's communicator and stream: in series, twice the bytes.
    two = ring_times(LLAMA, replace(lay, cp=2), cl, 0.0, 0.0)
    kv2 = kv_block_bytes(LLAMA, replace(lay, cp=2))
    assert two["cp_transfer"] == pytest.approx(p2p_time(2 * kv2, cl, False))
    assert two["cp_exposed_forward"] == pytest.approx(two["cp_transfer"])
    # Exposed time grows with c (more steps) when nothing hides it, past the half-duplex c = 2; none at c = 1.
    exposed = [ring_times(LLAMA, replace(lay, cp=c), cl, 0.0, 0.0).get("cp_exposed_backward", 0.0)
               for c in (1, 4, 8, 16)]
    assert exposed[0] == 0.0 and exposed == sorted(exposed)
    # The ring leaves the node once t·c does not fit in it: the same bytes take longer over InfiniBand.
    assert not cp_inter_node(lay, cl) and cp_inter_node(replace(lay, tp=4), cl)
    wide = replace(lay, tp=8, cp=2)  # t·c = 16 > 8 GPUs per node
    big_node = replace(cl, gpus_per_node=16)
    assert ring_times(LLAMA, wide, cl, 0, 0)["cp_transfer"] > 1.5 * ring_times(LLAMA, wide, big_node, 0, 0)[
        "cp_transfer"]


def test_layer_costs_divide_the_per_token_work_and_hide_the_ring_on_long_sequences():
    from mlplat.perf.cluster import layer_costs

    cl = a100()
    base = Layout(tp=2, pp=1, dp=1, global_batch_size=1, recompute="full", precision="bf16-megatron",
                  attention="flash", sequence_parallel=True)
    one = layer_costs(LLAMA, base, cl)
    four = layer_costs(LLAMA, replace(base, cp=4), cl)
    core = one.breakdown["attention_core_forward"]
    assert four.breakdown["attention_core_forward"] == pytest.approx(core / 4)
    assert four.layer_forward < one.layer_forward / 3  # GEMMs on 1/4 of the tokens (wave quantisation aside)
    assert four.tp_forward < one.tp_forward / 3.5
    # 8,192 tokens per rank: each block's attention outlasts its K/V transfer over NVLink.
    # Only the last dK/dV block's return home stays exposed.
    assert four.cp_forward == 0.0 and four.cp_backward == pytest.approx(four.breakdown["cp_transfer_dkv"])


def test_gradients_are_reduced_over_d_times_c():
    cl = a100()
    lay = Layout(tp=2, pp=1, dp=1, global_batch_size=1, recompute="full", precision="bf16-megatron",
                 attention="flash")
    assert predict(LLAMA, lay, cl).dp_exposed_seconds == 0.0
    assert predict(LLAMA, replace(lay, cp=2), cl).dp_exposed_seconds > 0.0  # c replicas of the weights


def _planner_kw():
    return dict(micro_batch_sizes=(1,), recompute=("full",), precision="bf16-megatron", distributed=(True,),
                max_vpp=1)


def test_planner_finds_a_context_parallel_layout_when_c1_does_not_fit():
    from mlplat.plan import format_table, search

    cl = a100()
    dims = replace(LLAMA, seq_len=262144)
    best, refused = search(dims, cl, 8, 8, top=2, cp=(1,), **_planner_kw())
    assert not best and refused["does not fit in memory"] > 0
    best, _ = search(dims, cl, 8, 8, top=2, **_planner_kw())  # cp=auto
    assert best and best[0].layout.cp > 1 and best[0].fits
    assert best[0].layout.gpus == 8
    head = format_table(best, cl).splitlines()[0].split()
    assert head[:4] == ["#", "t", "c", "p"]
    # Short sequences search c = 1 alone while it fits (the table has no c column then).
    short, _ = search(replace(LLAMA, seq_len=4096), cl, 8, 8, top=2, **_planner_kw())
    assert short and all(c.layout.cp == 1 for c in short)
    assert " c " not in format_table(short, cl).splitlines()[0]


def test_planner_falls_back_to_context_parallelism_for_a_short_sequence_that_does_not_fit():
    from mlplat.plan import search

    dims = replace(LLAMA, seq_len=16384)  # under LONG_SEQUENCE: c > 1 only once c = 1 does not fit
    tight = replace(a100(), gpu_memory_gb=20)
    assert not search(dims, tight, 8, 8, top=1, cp=(1,), **_planner_kw())[0]
    best, _ = search(dims, tight, 8, 8, top=1, **_planner_kw())
    assert best and best[0].layout.cp > 1
    roomy = replace(a100(), gpu_memory_gb=24)
    assert search(dims, roomy, 8, 8, top=1, **_planner_kw())[0][0].layout.cp == 1


def test_context_parallel_rules_come_from_the_config():
    from mlplat.perf.memory import layout_errors

    lay = Layout(tp=2, pp=1, dp=1, cp=3, global_batch_size=1)
    assert any("2·parallel.cp=6" in e for e in layout_errors(LLAMA, lay))
    gpt = ModelDims(4, 256, 4, 1024, 1000, dropout=0.1)
    assert any("model.dropout=0.1" in e for e in layout_errors(gpt, replace(lay, cp=2)))
    assert not layout_errors(LLAMA, replace(lay, cp=2))


def test_dry_run_shows_cp_and_the_ring_buffers():
    from mlplat.config import from_dict, validate
    from mlplat.perf.dry_run import format_plan, launch_overrides, plan

    cfg = from_dict({"model": {"arch": "llama", "n_layers": 4, "hidden": 128, "n_heads": 4, "n_kv_heads": 2,
                               "seq_len": 1024, "vocab_size": 256, "dropout": 0.0, "ffn_hidden": 352},
                     "parallel": {"tp": 2, "cp": 2, "pp": 2, "dp": 1, "micro_batch_size": 1,
                                  "global_batch_size": 4, "sequence_parallel": True},
                     "trainer": {"devices": 8}})
    validate(cfg, check_data=False)
    pl = plan(cfg, use_meta=False)
    assert pl["layout"]["cp"] == 2 and pl["layout"]["gpus"] == 8
    ring = pl["context_parallel"]
    assert pl["memory_breakdown_bytes"]["ring_buffers"] == 2 * ring["kv_block_bytes"] + 2 * ring["dkv_block_bytes"]
    assert ring["dkv_block_bytes"] == ring["kv_block_bytes"] > 0  # 32-true: dK/dV in the activations' dtype
    text = format_plan(pl)
    assert "t=2 c=2 p=2 v=1 d=1 = 8 GPUs" in text
    assert "context     c=2: each rank holds 512 tokens" in text and "ring_buffers" in text
    assert "cp ring exposed" in text
    assert "[1, 1024/2, 128/2]" in text  # the stage messages hold this rank's tokens
    assert "parallel.cp" not in " ".join(launch_overrides(pl["slurm_command"]))  # the config already says it


def test_profile_report_has_a_cp_comm_column(tmp_path):
    import json

    from mlplat.parallel.profile import CATEGORIES
    from mlplat.perf.profile_report import chrome_trace

    assert "cp_comm" in CATEGORIES
    rank = {"rank": 0, "coords": [0, 0, 0, 1], "offset": 0.0, "steps": [[1, 0.0, 1.0]],
            "spans": [["ring", "cp_comm", 0.1, 0.2, {}]], "breakdown": {"1": {"compute": 0.5}}}
    trace = chrome_trace([rank])
    lanes = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert "cp_comm" in lanes
    assert any(e.get("cat") == "cp_comm" for e in trace["traceEvents"])
    assert "c1" in json.dumps(trace)


def test_cpu_processes_model_counts_the_split_and_the_blocking_ring():
    """On CPU processes (gloo) nothing hides the ring: it is in the layer's blocking messages, beside the split
    compute; the world is t·c·p·d processes sharing the cores."""
    from mlplat.perf.cluster import Cluster
    from mlplat.plan import load_group

    cl = Cluster.from_config(load_group("cluster", "local_cpu"))
    dims = ModelDims.from_config({**load_group("model", "llama_tiny"), "vocab_size": 256})
    lay = Layout(tp=1, pp=2, dp=1, micro_batch_size=2, global_batch_size=8, precision="32-true", recompute="none")
    one, two = predict(dims, lay, cl), predict(dims, replace(lay, cp=2), cl)
    assert two.costs.layer_forward < one.costs.layer_forward  # half the tokens per rank
    assert one.costs.tp_forward == 0.0 < two.costs.tp_forward  # t = 1: the blocking messages are the ring's


def test_packed_documents_under_cp_on_gpus_are_planned_with_the_math_blocks_they_run():
    """The CUDA flash kernel takes no mask, so a GPU's ring blocks of packed documents run in math
    (parallel/context.block_kernel): the dry run counts their score blocks, not flash attention's."""
    from mlplat.config import from_dict, validate
    from mlplat.perf.dry_run import plan

    def planned(pack: bool) -> dict:
        cfg = from_dict({"model": {"arch": "llama", "n_layers": 4, "hidden": 128, "n_heads": 4, "n_kv_heads": 2,
                                   "seq_len": 1024, "vocab_size": 256, "dropout": 0.0, "ffn_hidden": 352},
                         "parallel": {"tp": 1, "cp": 2, "pp": 1, "dp": 1, "micro_batch_size": 1,
                                      "global_batch_size": 4},
                         "trainer": {"devices": 2, "accelerator": "gpu", "precision": "bf16-megatron"},
                         "cluster": {"device": "a100-80gb"}, "data": {"pack": pack}})
        validate(cfg, check_data=False)
        return plan(cfg, use_meta=False)

    plain, packed = planned(False), planned(True)
    assert (plain["layout"]["attention"], packed["layout"]["attention"]) == ("flash", "unfused")
    assert packed["memory_breakdown_bytes"]["activations"] > plain["memory_breakdown_bytes"]["activations"]
