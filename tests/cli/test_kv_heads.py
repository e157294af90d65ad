"""Key/value heads replicated over tensor-parallel ranks, end to end through the CLI (the grid's kv group comes from
the config): a Llama with one key/value head at t2 and one with two at t4 with sequence parallelism, in float64,
each resumed bit-exact under its own layout and resharded into the split layout (t1, t2), where its losses
continue the saved run's."""
from __future__ import annotations

import pytest

from tests.helpers.cli import read_metrics, run_train, train_losses

pytestmark = pytest.mark.slow

COMMON = ("parallel=single", "model=llama_tiny", "model.n_layers=2", "model.hidden=32", "model.n_heads=4",
          "model.ffn_hidden=64", "model.seq_len=32", "parallel.micro_batch_size=1", "parallel.global_batch_size=4",
          "trainer.precision=64-true", "trainer.max_steps=8", "checkpoint.every_steps=4", "logger=none",
          "sample.max_new_tokens=0", "trainer.val_check_interval=1000")
SAVED = {"mqa-tp2": ("model.n_kv_heads=1", "parallel.tp=2"),
         "kv2-tp4-sp": ("model.n_kv_heads=2", "parallel.tp=4", "parallel.sequence_parallel=true")}
RESHARDED = {"mqa-tp2": ("parallel.tp=1",), "kv2-tp4-sp": ("parallel.tp=2", "parallel.sequence_parallel=true")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per saved layout: 8 steps straight (saving step 4), resumed from step 4 under the same layout and under the
    split one."""
    root = tmp_path_factory.mktemp("kv_heads")
    for name, layout in SAVED.items():
        step4 = f"ckpt_path={root / name / 'straight' / 'checkpoints' / 'step-4'}"
        run_train(root / name / "straight", *COMMON, *layout)
        run_train(root / name / "resumed", *COMMON, *layout, step4)
        run_train(root / name / "resharded", *COMMON, *layout[:1], *RESHARDED[name], step4)
    return root


@pytest.mark.parametrize("name", list(SAVED))
def test_resume_is_bit_identical_and_resharding_continues_the_run(runs, name):
    straight = train_losses(runs / name / "straight")
    assert len(straight) == 8
    assert [int(r["step"]) for r in read_metrics(runs / name / "resumed")] == [5, 6, 7, 8]
    assert train_losses(runs / name / "resumed") == straight[4:]  # equal reprs: equal bits
    resharded = train_losses(runs / name / "resharded")
    assert len(resharded) == 4
    for step, (got, want) in enumerate(zip(resharded, straight[4:]), start=5):
        assert abs(got - want) <= 1e-9 * abs(want), f"{name} resharded, step {step}: {got!r} != {want!r}"
