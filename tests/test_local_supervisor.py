"""Which rank the local supervisor blames when several fail.

A regression: CI saw rank 1 SIGKILLed (the cause) and rank 0 then fail with gloo's "Connection
reset by peer" (the effect); rank 0 wrote its failure time before the supervisor's 50 ms poll saw
rank 1 die, so the job's reason named rank 0. The scenario below is that run's, times included.
"""

from __future__ import annotations

import pytest

from ringctl.backends.joblogs import is_peer_loss
from ringctl.backends.local import RankFailure, first_failure

RESET = (
    "RuntimeError: Read error [127.0.0.1]:39661: Connection reset by peer. This is typically "
    "caused by a remote worker hanging or bugs in the application."
)


@pytest.mark.parametrize(
    ("failures", "blamed"),
    [
        pytest.param(
            [
                RankFailure(rank=0, at=100.010, error=RESET, order=0),  # wrote its failure first
                RankFailure(rank=1, at=100.040, error="", order=1),  # SIGKILL, seen at next poll
            ],
            1,
            id="killed-rank-over-the-peer-it-took-down",
        ),
        pytest.param(
            [
                RankFailure(rank=2, at=100.050, error="", order=0),  # aborted after its peer raised
                RankFailure(rank=0, at=100.000, error="ValueError: bad document", order=1),
            ],
            0,
            id="real-error-over-a-later-death-it-caused",
        ),
        pytest.param(
            [
                RankFailure(
                    rank=3, at=5.0, error="RuntimeError: Connection closed by peer", order=0
                ),
                RankFailure(rank=1, at=4.0, error=RESET, order=1),
            ],
            1,
            id="every-rank-lost-a-peer-earliest-blamed",
        ),
    ],
)
def test_the_cause_is_blamed_not_its_effects(failures, blamed):
    assert first_failure(failures) == blamed


def test_peer_loss_is_recognised_only_by_its_words():
    assert is_peer_loss(RESET)
    assert is_peer_loss("DistBackendError: NCCL communicator was aborted on rank 3")
    assert not is_peer_loss("RuntimeError: injected fault on rank 2")
    assert not is_peer_loss("RuntimeError: Timed out waiting 3000ms for recv operation")
