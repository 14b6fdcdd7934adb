"""The shm weight publisher's prewarm: the segments for the versions it keeps are made in the
background after its first publication, so the next publications create none; a spare that could not
be made is made on demand, and nothing is left in /dev/shm.

Segments are counted as files in /dev/shm under the publisher's own prefix."""

from __future__ import annotations

import logging

import pytest
import torch

from areal_async.transport import make_weight_channel
from areal_async.transport import shm_weights as W
from areal_async.transport.shm import SHM_DIR
from tests.support.transport_helpers import assert_bit_exact, no_shm_leaks  # noqa: F401

pytestmark = [
    pytest.mark.usefixtures("no_shm_leaks"),
    pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm"),
]


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(4096, generator=g) for n in ("a", "b", "c")}  # 48 KiB


def _segments(ch) -> set[str]:
    return {p.name for p in SHM_DIR.glob(f"{ch._prefix}_w*")}


def _settle(ch) -> None:
    for spare in ch._spares:
        spare.exception(timeout=30)


def test_after_prewarm_the_kept_versions_and_the_next_one_create_no_segment():
    """A trainer's pattern: publish v, release v - 2. Without prewarm v0, v1, v2 each make a segment
    while publishing; with prewarm(3) after v0, the two spares are made in the background and v1..v5
    make none: 3 segments in all, each receiver still reads its version bit-exact."""
    pub = make_weight_channel("shm", role="publisher", bucket_mb=0.02)
    rx = make_weight_channel("shm", role="receiver")
    try:
        made = []
        pub.publish_begin(0, _weights(0))
        pub.publish_end()
        made.append(_segments(pub))
        pub.prewarm(3)
        _settle(pub)
        assert len(_segments(pub)) == 3  # v0's and two spares, made off the publication
        for v in range(1, 6):
            sd = _weights(v)
            m = pub.publish_begin(v, sd)
            pub.publish_end()
            assert_bit_exact(rx.receive(m), sd)
            made.append(_segments(pub))
            if v >= 2:
                pub.release(v - 2)
        assert len(made[0]) == 1 and all(s == made[1] for s in made[1:]) and len(made[1]) == 3
        pub.prewarm(3)  # already room for three: nothing more is made
        assert pub._spares == [] and len(_segments(pub)) == 3
    finally:
        rx.close()
        pub.close()


def test_without_prewarm_each_held_version_makes_its_segment_while_publishing():
    """The baseline the prewarm test is read against: the same pattern, no prewarm, a segment made
    inside publish_begin of v0, v1 and v2 (then reused)."""
    pub = make_weight_channel("shm", role="publisher", bucket_mb=0.02)
    try:
        counts = []
        for v in range(5):
            pub.publish_begin(v, _weights(v))
            pub.publish_end()
            counts.append(len(_segments(pub)))
            if v >= 2:
                pub.release(v - 2)
        assert counts == [1, 2, 3, 3, 3]
    finally:
        pub.close()


def test_a_spare_that_cannot_be_made_is_made_on_demand_and_the_version_lands(caplog):
    """The name the spare would take already exists (O_EXCL refuses it): the publication that needs
    a segment logs why and makes its own, and the receiver gets that version bit-exact."""
    pub = make_weight_channel("shm", role="publisher", bucket_mb=0.02)
    rx = make_weight_channel("shm", role="receiver")
    squatter = SHM_DIR / f"{pub._prefix}_w1"
    try:
        pub.publish_begin(0, _weights(0))
        pub.publish_end()
        squatter.write_bytes(b"someone else's")
        pub.prewarm(2)
        _settle(pub)
        assert isinstance(pub._spares[0].exception(), FileExistsError)
        sd = _weights(1)
        with caplog.at_level(logging.WARNING, logger=W.__name__):
            m = pub.publish_begin(1, sd)  # v0 unreleased: it needs a second segment
            pub.publish_end()
        assert "could not be made" in caplog.text and "making it on demand" in caplog.text
        assert_bit_exact(rx.receive(m), sd)
        assert squatter.read_bytes() == b"someone else's"  # not touched
    finally:
        squatter.unlink(missing_ok=True)
        rx.close()
        pub.close()


def test_close_unlinks_spares_still_being_made_and_prewarm_refuses_misuse():
    pub = make_weight_channel("shm", role="publisher", bucket_mb=0.02)
    rx = make_weight_channel("shm", role="receiver")
    try:
        with pytest.raises(RuntimeError, match="after its first publication"):
            pub.prewarm(2)
        with pytest.raises(RuntimeError, match="for a publisher"):
            rx.prewarm(2)
        pub.publish_begin(0, _weights(0))
        pub.publish_end()
        for bad in (0, W.POOL + 1, 2.0):
            with pytest.raises(ValueError, match="versions="):
                pub.prewarm(bad)
        pub.prewarm(W.POOL)
    finally:
        rx.close()
        pub.close()  # no_shm_leaks: the spares, made or being made, are gone too
    assert _segments(pub) == set()


def test_the_delta_wrapper_forwards_prewarm_to_its_shm_channel():
    """Item 10 of issue 36: with ``tensor_channel.weight_delta`` the trainer's prewarm reaches the wrapper,
    which must pass it on (it was the base class's no-op): after v0 and prewarm(3), the inner shm publisher
    holds v0's segment and two spares of its size; v1 (full, since v0 differs everywhere) then makes none."""
    pub = make_weight_channel("shm", role="publisher", bucket_mb=0.02, delta=True)
    rx = make_weight_channel("shm", role="receiver", delta=True)
    try:
        pub.publish_begin(0, _weights(0))
        pub.publish_end()
        pub.prewarm(3)
        _settle(pub.inner)
        assert len(_segments(pub.inner)) == 3
        sd = _weights(1)
        m = pub.publish_begin(1, sd)
        pub.publish_end()
        assert_bit_exact(rx.receive(m), sd) and len(_segments(pub.inner)) == 3
    finally:
        rx.close()
        pub.close()
