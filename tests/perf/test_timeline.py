"""mlplat.perf.timeline: the schedule plot's CLI."""

from __future__ import annotations

import pytest


def test_timeline_cli_writes_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from mlplat.perf import timeline

    out = tmp_path / "t.png"
    timeline.main(["--schedule", "interleaved", "-p", "2", "-v", "2", "-m", "2", "-o", str(out),
                   "--transfer", "0.1"])
    assert out.stat().st_size > 1000
    assert "bubble" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        timeline.main(["--schedule", "interleaved", "-p", "4", "-v", "2", "-m", "6", "-o", str(out)])
