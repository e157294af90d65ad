"""A hostile checkpoint: lightning.pt replaced by a pickle that runs code when loaded (tests/checkpoint/test_io.py
and the CLI's tests/cli/test_checkpoint.py check that load and export refuse it)."""
from __future__ import annotations

import json
from pathlib import Path

import torch


class _RunsCode:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):  # unpickling calls Path.touch(marker): code from the checkpoint runs on the loader
        return (Path.touch, (Path(self.marker),))


def plant_code_running_pickle(ckpt: Path, marker: Path) -> None:
    """Replace ckpt/lightning.pt with a pickle that would create `marker`, and fix the manifest to match."""
    from mlplat.checkpoint import io

    target = ckpt / io.LIGHTNING_STATE
    torch.save({"global_step": 2, "payload": _RunsCode(str(marker))}, target)
    manifest = json.loads((ckpt / io.MANIFEST).read_text())
    manifest["files"][io.LIGHTNING_STATE].update(bytes=target.stat().st_size, crc32=io.crc32(target))
    (ckpt / io.MANIFEST).write_text(json.dumps(manifest))
