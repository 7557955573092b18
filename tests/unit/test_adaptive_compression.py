"""`compression.kind: auto`'s controller on its own: the link fit, the modelled choice,
hysteresis, the loss-drift guard and exact resume (pure figures, no processes)."""

from __future__ import annotations

import pytest

from trainstack.compression.auto import AdaptiveRatio, LinkFit

WORLD = 2
DENSE = 25_000_000
"""Bytes of the dense gradient (a 6 M-parameter model)."""


def comm_bytes(ratio: float) -> tuple[int, int]:
    """(all-reduced, all-gathered): top-k sends 8 bytes per kept coordinate of 4-byte ones."""
    return (DENSE, 0) if ratio >= 1.0 else (0, int(8 * ratio * DENSE / 4))


def controller(**kwargs: object) -> AdaptiveRatio:
    return AdaptiveRatio(
        candidates=(1.0, 0.1, 0.01), comm_bytes=comm_bytes, world_size=WORLD, **kwargs
    )


def all_reduce_s(size: int, fit: LinkFit) -> float:
    return fit.seconds(reduced=size, gathered=0, world_size=WORLD)


def probe(c: AdaptiveRatio, fit: LinkFit) -> None:
    c.observe_link([(s, all_reduce_s(s, fit)) for s in (DENSE, DENSE // 10, DENSE // 100)])


def run(c: AdaptiveRatio, steps: range, *, compute_s: float, codec_s: float, loss: object) -> list:
    """Feed steps whose time is compute + codec + the link's modelled comm."""
    decisions = []
    for step in steps:
        link = c._link()
        assert link is not None
        reduced, gathered = comm_bytes(c.ratio)
        comm = link.seconds(reduced=reduced, gathered=gathered, world_size=WORLD)
        codec = codec_s if c.ratio < 1.0 else 0.0
        value = loss(step) if callable(loss) else loss
        decision = c.observe_step(step, step_s=compute_s + codec + comm, codec_s=codec, loss=value)
        if decision is not None:
            decisions.append(decision)
    return decisions


def test_link_fit_recovers_latency_and_bandwidth() -> None:
    truth = LinkFit(latency_s=50e-6, bytes_per_s=1.25e8)
    fit = LinkFit.from_timings(
        [(s, all_reduce_s(s, truth)) for s in (DENSE, DENSE // 10, DENSE // 100)],
        world_size=WORLD,
    )
    assert fit.latency_s == pytest.approx(50e-6, rel=1e-6)
    assert fit.bytes_per_s == pytest.approx(1.25e8, rel=1e-6)


def test_a_slow_link_moves_to_sparse_top_k_and_says_why() -> None:
    c = controller()
    probe(c, LinkFit(latency_s=50e-6, bytes_per_s=1.25e8))  # 1 Gbit/s: 200 ms dense
    decisions = run(c, range(1, 31), compute_s=0.05, codec_s=0.005, loss=3.0)
    assert [d.ratio for d in decisions] == [0.01]
    assert decisions[0].step == 10
    assert "top-k 0.01: modelled step" in decisions[0].reason
    assert "at dense" in decisions[0].reason and "0.125 GB/s" in decisions[0].reason


def test_a_fast_link_stays_dense() -> None:
    c = controller()
    probe(c, LinkFit(latency_s=10e-6, bytes_per_s=1e10))  # 2.5 ms dense
    assert run(c, range(1, 51), compute_s=0.05, codec_s=0.005, loss=3.0) == []
    assert c.ratio == 1.0


def test_a_gain_under_the_margin_does_not_switch() -> None:
    # dense comm 5 ms, top-k's 0.1 ms + 4 ms of codec: 1.8% faster of a 50 ms step
    # (codec seconds known, as after a first compressed step: unknown, they count 0)
    c = controller(margin=0.05)
    probe(c, LinkFit(latency_s=0.0, bytes_per_s=DENSE / 0.005))
    c.state.codec_s = 0.004
    assert run(c, range(1, 51), compute_s=0.045, codec_s=0.004, loss=3.0) == []
    wide = controller(margin=0.01)
    probe(wide, LinkFit(latency_s=0.0, bytes_per_s=DENSE / 0.005))
    wide.state.codec_s = 0.004
    assert [d.ratio for d in run(wide, range(1, 11), compute_s=0.045, codec_s=0.004, loss=3.0)]


def test_a_loss_drift_after_a_switch_goes_back_and_bars_sparser_ratios() -> None:
    c = controller(drift=0.02, guard_steps=100)
    slow = LinkFit(latency_s=50e-6, bytes_per_s=1.25e8)
    probe(c, slow)
    run(c, range(1, 11), compute_s=0.05, codec_s=0.005, loss=3.0)
    assert c.ratio == 0.01
    rising = run(c, range(11, 120), compute_s=0.05, codec_s=0.005, loss=lambda s: 3.0 + 0.01 * s)
    assert rising[0].ratio == 1.0
    assert "above its level at the switch" in rising[0].reason
    back_at = rising[0].step
    # barred: the slow link would pick 0.01 at once, but not during the back-off
    later = run(c, range(back_at + 1, back_at + 100), compute_s=0.05, codec_s=0.005, loss=3.0)
    assert all(d.ratio >= 1.0 for d in later)
    after = run(c, range(back_at + 100, back_at + 130), compute_s=0.05, codec_s=0.005, loss=3.0)
    assert [d.ratio for d in after][:1] == [0.01]


def test_a_steady_loss_keeps_the_sparse_ratio() -> None:
    c = controller(drift=0.02, guard_steps=100)
    probe(c, LinkFit(latency_s=50e-6, bytes_per_s=1.25e8))
    decisions = run(c, range(1, 300), compute_s=0.05, codec_s=0.005, loss=lambda s: 3.0 - s / 1e3)
    assert [d.ratio for d in decisions] == [0.01]


def test_state_dict_resumes_to_the_same_decisions() -> None:
    slow = LinkFit(latency_s=50e-6, bytes_per_s=1.25e8)
    a = controller()
    probe(a, slow)
    run(a, range(1, 15), compute_s=0.05, codec_s=0.005, loss=3.0)
    b = controller()
    b.load_state_dict(a.state_dict())
    rising = lambda s: 3.0 + 0.01 * s  # noqa: E731
    ours = run(a, range(15, 80), compute_s=0.05, codec_s=0.005, loss=rising)
    theirs = run(b, range(15, 80), compute_s=0.05, codec_s=0.005, loss=rising)
    assert ours == theirs and ours  # the guard fired in both, identically
    fresh = controller()  # without the state: dense, no link, nothing to revert
    probe(fresh, slow)
    assert run(fresh, range(15, 80), compute_s=0.05, codec_s=0.005, loss=rising) != ours


def test_an_assumed_link_needs_no_probe() -> None:
    c = controller(assumed_link=LinkFit(latency_s=10e-6, bytes_per_s=6.25e6))
    assert not any(c.wants_probe(step) for step in range(1, 500))
    assert run(c, range(1, 11), compute_s=0.05, codec_s=0.005, loss=3.0)[0].ratio == 0.01
