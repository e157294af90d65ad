"""Multi-token prediction through `python -m mlplat.train`: a Llama with D = 2 modules on packed documents, in one
process and over two pipeline stages (the word embedding's copy on the last), float64. Each depth's loss is in
metrics.csv, W&B, the step line and the run summary, and equals one process's; so is its validation loss."""
from __future__ import annotations

import pytest

from tests.cli.test_train import EQUIV_COMMON, PACKED, short_documents
from tests.helpers.cli import read_metrics, read_wandb_run, run_train

MTP = ("model=llama_tiny", "model.mtp.depth=2", "model.mtp.loss_coeff=0.4", *PACKED)
COLUMNS = ["mtp_loss/depth1", "mtp_loss/depth2"]
VALIDATION = ("trainer.limit_val_batches=1", "trainer.val_check_interval=2")  # after steps 2 and 3
RTOL = 1e-9


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("mtp")
    documents = short_documents(base / "docs")
    out = {}
    for name, extra in (("one-process", ("logger=wandb",)), ("pp2", ("parallel.pp=2",))):
        run_train(base / name, *EQUIV_COMMON, *(o.format(short_documents=documents) for o in MTP), *extra,
                  *VALIDATION, timeout=600)
        out[name] = base / name
    return out


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-300)


def test_each_depths_loss_is_logged_and_equals_one_process(runs):
    ref, got = read_metrics(runs["one-process"]), read_metrics(runs["pp2"])
    val = [f"val_{c}" for c in COLUMNS]
    assert [c for c in ref[0] if "mtp_" in c] == COLUMNS + val == [c for c in got[0] if "mtp_" in c]
    assert [r["step"] for r in ref if r["val_mtp_loss/depth2"]] == ["2", "3"]
    for r, g in zip(ref, got):
        for c in ("train_loss", *COLUMNS, *((("val_loss", *val)) if r["val_loss"] else ())):
            assert _rel(float(g[c]), float(r[c])) <= RTOL, (r["step"], c, g[c], r[c])
        # the modules predict further ahead: not the language-model loss
        assert float(r["mtp_loss/depth1"]) != float(r["train_loss"])
    log = (runs["one-process"] / "train.log").read_text()
    first, last = ref[0], ref[-1]
    assert f"mtp loss {float(first['mtp_loss/depth1']):.4f} | " in log
    assert (f"mtp loss    depth 1 {float(first['mtp_loss/depth1']):.3f} -> {float(last['mtp_loss/depth1']):.3f}, "
            f"depth 2 {float(first['mtp_loss/depth2']):.3f} -> {float(last['mtp_loss/depth2']):.3f} (step 1 -> 3)"
            ) in log, log[-800:]
    summary = read_wandb_run(runs["one-process"])["summary"]  # the W&B run's last values: the last step's
    for c in (*COLUMNS, *val):
        assert summary[c] == float(last[c]), (c, summary.get(c), last[c])
