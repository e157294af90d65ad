"""The paired passes' alternation (mlplat.parallel.pipeline.pair): strict turns at each hand-over, and a side that
fails ends the pair at once: the other posts nothing more and the failure itself is what `run` raises."""
from __future__ import annotations

import pytest

from mlplat.parallel.pipeline.pair import Alternation


def _side(alt: Alternation, name: str, posts: int, log: list, fail_after: int | None = None):
    def run():
        for i in range(posts):
            if fail_after is not None and i == fail_after:
                raise ValueError(f"{name} broke")
            log.append(f"{name}{i}")  # "posting" a collective, then handing over
            alt.hand_over()
    return run


def test_the_passes_take_turns_at_each_post_and_run_to_their_ends():
    alt, log = Alternation(), []
    alt.posts = []
    alt.run(_side(alt, "F", 3, log), _side(alt, "B", 5, log))
    assert log == ["F0", "B0", "F1", "B1", "F2", "B2", "B3", "B4"]
    alt.hand_over()  # between pairs: nothing
    assert alt.posts == ["F", "B", "F", "B", "F", "B", "B", "B"]


@pytest.mark.parametrize("failing", ["F", "B"])
def test_a_failing_side_stops_the_other_at_its_next_hand_over_and_its_error_is_raised(failing):
    alt, log = Alternation(), []
    forward = _side(alt, "F", 4, log, fail_after=2 if failing == "F" else None)
    backward = _side(alt, "B", 4, log, fail_after=1 if failing == "B" else None)
    with pytest.raises(ValueError, match=f"{failing} broke"):
        alt.run(forward, backward)
    # B fails in its 2nd turn (F has posted F0, F1): F stops at the hand-over after F1, posting nothing more.
    # F fails in its 3rd turn (B has posted B0, B1): B stops at the hand-over after B1.
    assert log == ["F0", "B0", "F1"] if failing == "B" else ["F0", "B0", "F1", "B1"]
    # the next pair starts clean
    log.clear()
    alt.run(_side(alt, "F", 2, log), _side(alt, "B", 2, log))
    assert log == ["F0", "B0", "F1", "B1"]


def test_a_forward_failing_before_its_first_hand_over_never_starts_the_backward():
    alt, log = Alternation(), []
    with pytest.raises(ValueError, match="F broke"):
        alt.run(_side(alt, "F", 2, log, fail_after=0), _side(alt, "B", 2, log))
    assert log == []
