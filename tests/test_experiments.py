"""Every script under experiments/ still imports against the current package.

The benchmarks run for minutes, so the suite does not run them; a rename in mlplat (a function moved to the
pipeline-layout object, say) would otherwise break them silently until someone reruns one. One fresh
interpreter loads each script as a module (its `__main__` block does not run) and reports the ones that fail.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.helpers.paths import REPO

PROBE = r"""
import importlib.util, json, pathlib, sys, traceback

failed = {}
for i, path in enumerate(json.loads(sys.argv[1])):
    spec = importlib.util.spec_from_file_location(f"experiment_{i}", path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look it up there
    try:
        spec.loader.exec_module(module)
    except BaseException:
        failed[path] = traceback.format_exc(limit=-2)
print(json.dumps(failed))
"""


def test_every_experiment_script_imports():
    scripts = sorted(str(p.relative_to(REPO)) for p in (REPO / "experiments").glob("**/*.py"))
    assert len(scripts) >= 10, scripts
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(scripts)], cwd=REPO, capture_output=True,
                         text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(REPO), WANDB_MODE="offline", MPLBACKEND="Agg"))
    assert out.returncode == 0, out.stderr[-3000:]
    failed = json.loads(out.stdout.strip().splitlines()[-1])
    assert not failed, "\n".join(f"{path}:\n{tb}" for path, tb in failed.items())


def test_the_fp8_figures_in_the_docs_are_the_predictions():
    """docs/precision.md quotes Llama 3 405B's and gpt1t's steps with and without FP8 from experiments/fp8/
    predictions.md (bf16-megatron, then tensorwise): the page says the file's numbers, not an older run's."""
    rows = {}
    for line in (REPO / "experiments" / "fp8" / "predictions.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) > 7:
            rows[cells[0]] = cells[3:7]  # bf16 s, TFLOP/s, tensorwise s, TFLOP/s
    docs = " ".join((REPO / "docs" / "precision.md").read_text().split())
    bf16_s, bf16_tf, fp8_s, fp8_tf = rows["llama3_405b"]
    assert f"Llama 3 405B: {bf16_s} → {fp8_s} s per step, {bf16_tf} → {fp8_tf} model TFLOP/s" in docs
    assert f"gpt1t: {rows['gpt1t'][0]} → {rows['gpt1t'][2]} s" in docs
