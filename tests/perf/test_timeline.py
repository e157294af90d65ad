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


def test_the_legend_says_what_the_numbers_rows_and_gaps_are():
    """The number in a box is its micro-batch, a row is a pipeline rank (a profile adds its global rank), and the
    white is named: the bubble in a simulation; in a profile, the step's time between the boxes and inside them."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from mlplat.parallel.layout.schedules import build_schedule
    from mlplat.perf.profile_report import where_the_step_went
    from mlplat.perf.simulator import CostModel, simulate_nccl
    from mlplat.perf.timeline import plot_timeline

    result = simulate_nccl(build_schedule("interleaved", 2, 2, 4), CostModel(), 2)
    ax = plot_timeline(result, 2, 2)
    legend = ax.get_legend()
    assert legend.get_title().get_text() == "the number in a box is its micro-batch (from 1)"
    assert [t.get_text() for t in ax.get_yticklabels()] == ["pipeline rank 0", "pipeline rank 1"]
    assert legend.get_texts()[-1].get_text() == "no F/B/W: waiting on a neighbour (the bubble)"
    plt.close(ax.figure)

    parts = {"compute": 0.3, "tp_comm": 0.2, "bubble": 0.1, "dp_comm": 0.05, "data": 0.05, "optimizer": 0.0,
             "cp_comm": 0.0, "recompute": 0.0, "loop": 0.0}
    gaps = where_the_step_went(parts)
    assert gaps == "bubble 14%, dp_comm 7%, data 7% between the boxes;\ncompute 43%, tp_comm 29% inside them"
    ax = plot_timeline(result, 2, 2, rank_labels=["pipeline rank 0 (rank 0)", "pipeline rank 1 (rank 2)"], gaps=gaps)
    assert [t.get_text() for t in ax.get_yticklabels()][1] == "pipeline rank 1 (rank 2)"
    assert ax.get_legend().get_texts()[-1].get_text() == f"no F/B/W: {gaps}"
    plt.close(ax.figure)
