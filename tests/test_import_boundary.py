"""The library under the training entry point does not import Lightning or Hydra.

mlplat.parallel, mlplat.model, mlplat.perf, mlplat.data and mlplat.checkpoint are plain PyTorch: only
mlplat.lightning, mlplat.train (and the config loader's Hydra side) may bring in the frameworks. A fresh
interpreter imports every module of those packages, one at a time, and records which forbidden package appeared
after which module; an import hook records the chain of modules that were executing when it was first imported.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.paths import REPO

PACKAGES = ("mlplat.parallel", "mlplat.model", "mlplat.perf", "mlplat.data", "mlplat.checkpoint")
FORBIDDEN = ("pytorch_lightning", "lightning", "lightning_fabric", "hydra", "hydra_plugins")

PROBE = r"""
import importlib, json, pkgutil, sys, traceback

PACKAGES, FORBIDDEN = json.loads(sys.argv[1])
chains = {}


class Watch:
    # The first import of a forbidden package: note the modules whose top-level code is running (outermost first).
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in FORBIDDEN and top not in chains:
            chain, frame = [], sys._getframe(1)
            while frame is not None:
                if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") != "__main__":
                    chain.append(frame.f_globals.get("__name__"))
                frame = frame.f_back
            chains[top] = chain[::-1] + [name]
        return None


def forbidden():
    return {m.partition(".")[0] for m in sys.modules} & set(FORBIDDEN)


def walk(name):
    # Like pkgutil.walk_packages, but importing (and checking) one module before looking inside it.
    yield name
    module = sys.modules[name]
    for info in pkgutil.iter_modules(getattr(module, "__path__", []), name + "."):
        importlib.import_module(info.name)
        yield from walk(info.name)


sys.meta_path.insert(0, Watch())
report = {"already": sorted(forbidden()), "imported": [], "offenders": [], "chains": chains, "error": None}
seen = set(report["already"])
try:
    for package in PACKAGES:
        importlib.import_module(package)
        for name in walk(package):
            report["imported"].append(name)
            new = forbidden() - seen
            if new:
                report["offenders"].append([name, sorted(new)])
                seen |= new
except Exception:
    report["error"] = traceback.format_exc()
report["mlplat"] = sys.modules["mlplat"].__file__ if "mlplat" in sys.modules else None
print(json.dumps(report))
"""


def _probe() -> dict:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps([PACKAGES, FORBIDDEN])], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_parallel_model_perf_data_checkpoint_import_neither_lightning_nor_hydra():
    report = _probe()
    assert report["error"] is None, f"importing the library failed:\n{report['error']}"
    assert report["mlplat"].startswith(str(REPO)), f"imported {report['mlplat']}, not this checkout's mlplat"
    assert not report["already"], f"the interpreter starts with {report['already']} imported"
    assert set(PACKAGES) <= set(report["imported"]) and len(report["imported"]) > 30, report["imported"]
    lines = []
    for module, packages in report["offenders"]:
        for package in sorted(packages, key=FORBIDDEN.index):
            chain = " -> ".join(report["chains"].get(package, [module, package]))
            lines.append(f"{package} is imported once {module} is (import chain: {chain})")
    if lines:
        pytest.fail("Lightning/Hydra imported below mlplat.lightning and mlplat.train:\n  " + "\n  ".join(lines),
                    pytrace=False)
