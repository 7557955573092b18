"""`strategy.allreduce: auto`'s choice under the α-β model: flat when the links within
and across nodes are alike and the gradients are large (a flat ring sends less per
rank), two levels when the inter-node link is slow, and the formula itself."""

import pytest

from trainstack.compression.auto import LinkFit
from trainstack.strategies.hierarchical import choose_levels

FAST = LinkFit(latency_s=5e-6, bytes_per_s=100e9)  # within a node: NVLink-like
SLOW = LinkFit(latency_s=20e-6, bytes_per_s=10e9)  # across nodes: a 100 Gbit/s-class NIC


def test_two_levels_win_when_the_network_is_ten_times_slower_than_the_node() -> None:
    choice = choose_levels(FAST, SLOW, grad_bytes=500 * 2**20, ranks_per_node=(8, 8))
    # per byte: 1.5 · 2·7/8 / 100e9 + 2·1/2 / 10e9 = 0.126 ns, a flat ring 2·15/16 / 10e9 = 0.188
    assert choice.hierarchical and choice.two_levels_s < 0.7 * choice.flat_s
    assert "all-reduce auto: two levels" in choice.describe()


def test_a_flat_ring_wins_on_alike_links_with_large_gradients() -> None:
    choice = choose_levels(SLOW, SLOW, grad_bytes=500 * 2**20, ranks_per_node=(2, 2))
    assert not choice.hierarchical
    assert choice.figures()["chosen"] == "flat"


def test_the_modelled_seconds_are_the_ring_formulas() -> None:
    a, beta, size = 1e-3, 1e9, 4_000_000
    link = LinkFit(latency_s=a, bytes_per_s=beta)
    choice = choose_levels(link, link, grad_bytes=size, ranks_per_node=(2, 2))
    ring = lambda n: 2 * (n - 1) * a + 2 * (n - 1) / n * size / beta  # noqa: E731
    assert choice.flat_s == pytest.approx(ring(4))
    # within the node (and half again for the broadcast back), then across 2 leaders
    assert choice.two_levels_s == pytest.approx(1.5 * ring(2) + ring(2))
