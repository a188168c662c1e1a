"""Ranks: a group's members as strides, checked against the list of them."""

import itertools

import pytest
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from meshstate.layout.ranks import Ranks, identity
from meshstate.testing import fake_world


@st.composite
def grid_lattices(draw):
    """A rank's group on a grid of up to 4 axes: strides are the grid's prefix products."""
    sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    strides = list(itertools.accumulate([1] + sizes[:-1], lambda a, b: a * b))
    axes = draw(st.permutations(range(len(sizes))))
    picked = axes[: draw(st.integers(1, len(sizes)))]
    base = draw(st.integers(0, 50))
    return base, [(strides[a], sizes[a]) for a in picked]


def _listed(base, steps):
    return [base + sum(i * s for i, (s, _) in zip(digits, steps))
            for digits in itertools.product(*(range(c) for _, c in steps))]


@settings(max_examples=300, deadline=None)
@given(grid_lattices(), st.data())
def test_every_query_answers_as_the_list_does(lattice, data):
    base, steps = lattice
    ranks, listed = Ranks(base, steps), _listed(base, steps)
    assert list(ranks) == listed and ranks == tuple(listed) and tuple(listed) == ranks
    assert len(ranks) == len(listed) and hash(ranks) == hash(tuple(listed))
    for position, rank in enumerate(listed):
        assert ranks[position] == rank == ranks[position - len(listed)]
        assert ranks.index(rank) == position
    for rank in range(max(listed) + 3):
        assert (rank in ranks) == (rank in listed)
    assert list(ranks.sorted()) == sorted(listed)
    start = data.draw(st.integers(0, len(listed) - 1))
    positions = range(start, data.draw(st.integers(start + 1, len(listed))),
                      data.draw(st.integers(1, len(listed))))
    taken = ranks.take(positions)
    if taken is not None:
        assert list(taken) == [listed[p] for p in positions]


def test_a_whole_axis_or_an_aligned_part_is_taken_by_strides():
    ranks = Ranks(0, ((16, 4), (1, 8)))
    assert ranks.take(range(8, 16)) == Ranks(16, ((1, 8),))
    assert ranks.take(range(3, 32, 8)) == Ranks(3, ((16, 4),))
    assert ranks.take(range(6, 10)) is None  # straddles a step unevenly


def test_out_of_range_and_absent_ranks_raise_as_for_a_tuple():
    ranks = Ranks(4, ((2, 3),))
    with pytest.raises(IndexError):
        ranks[3]
    with pytest.raises(ValueError):
        ranks.index(5)
    assert ranks[::-1] == (8, 6, 4) and 5 not in ranks and "4" not in ranks


def test_identity_is_the_lattice_for_a_large_group_and_the_tuple_for_a_small_one():
    assert identity(Ranks(0, ((1, 4),))) == identity((0, 1, 2, 3))
    assert identity(Ranks(0, ((1, 2**20),))) == (0, ((1, 2**20),))


def test_torch_reads_a_group_kept_as_strides_as_it_reads_its_own():
    """A 131,072-member group of a simulated 1,048,576-rank world: no dict of its members."""
    import meshstate

    world, rank = 2**20, 2**19 + 5
    with fake_world(rank, world):
        mesh = meshstate.init_mesh(tp=8, cp=2, pp=8, ep=8, etp=1)
        try:
            group, ranks = mesh.group("tp-dp-cp"), mesh.ranks("tp-dp-cp")
            assert isinstance(ranks, Ranks) and len(ranks) == 2**17
            assert dist.get_rank(group) == ranks.index(rank) == mesh.rank("tp-dp-cp")
            assert dist.get_group_rank(group, ranks[7]) == 7
            assert dist.get_global_rank(group, 3) == ranks[3]
            assert dist.get_process_group_ranks(group) == list(ranks)
            with pytest.raises(ValueError):
                dist.get_group_rank(group, (ranks[-1] + 1) % world)
        finally:
            mesh.destroy()
