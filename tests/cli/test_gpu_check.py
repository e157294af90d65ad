"""experiments/gpu_check/run.sh, the one script a first GPU runs, says what failed and exits non-zero then: run
here with a stand-in `python` whose chosen parts fail (the parts themselves need a CUDA device)."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests.helpers.paths import REPO

PARTS = ["cuda", "pytest", "train", "resume", "megatron", "megatron_resume", "kernels", "fp8", "fp8_train", "moe"]
FAKE_PYTHON = '#!/bin/sh\ncase "$*" in *"$FAIL"*) echo "failing: $*"; exit 3;; esac\nexit 0\n'


@pytest.mark.parametrize("fail, failed", [("", PARTS), ("kernels_gpu", ["kernels"]), ("nothing-fails", [])])
def test_gpu_check_exits_non_zero_when_any_part_fails(tmp_path, fail, failed):
    script = tmp_path / "experiments" / "gpu_check" / "run.sh"
    script.parent.mkdir(parents=True)
    shutil.copy(REPO / "experiments" / "gpu_check" / "run.sh", script)
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python").write_text(FAKE_PYTHON)
    (fake / "python").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}", "FAIL": fail}
    proc = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    summary = (script.parent / "results" / "summary.txt").read_text()
    assert [line.split()[0] for line in summary.splitlines() if " exit " in line] == PARTS
    for part in PARTS:
        assert f"{part} exit {3 if part in failed else 0}" in summary
    if failed:
        assert proc.returncode == 1, proc.stdout
        assert f"gpu_check: {len(failed)} of {len(PARTS)} parts failed: {' '.join(failed)}" in proc.stdout
    else:
        assert proc.returncode == 0, proc.stdout
        assert f"gpu_check: all {len(PARTS)} parts passed" in proc.stdout
