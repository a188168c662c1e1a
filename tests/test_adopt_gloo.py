"""meshstate.adopt on 4 gloo ranks: the caller's groups, checked with one collective."""

import pytest
import torch.distributed as dist

import meshstate
from meshstate.testing import distributed
from meshstate.tools.verify import verify_mesh


def _family(rank_lists):
    """Every rank calls new_group for every list (torch's rule); returns the caller's group."""
    mine = None
    for ranks in rank_lists:
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    return mine


@distributed(world_size=4)
def test_adopt_takes_correct_groups_and_names_the_wrong_axis():
    tp = _family([[0, 1], [2, 3]])
    dp = _family([[0, 2], [1, 3]])
    mesh = meshstate.adopt({"tp": tp, "dp": dp}, tp=2)
    assert mesh.group("tp") is tp and mesh.group("dp") is dp
    assert mesh.ranks("tp-dp") == (0, 1, 2, 3)
    failed = [(check.key, check.problems) for check in verify_mesh(mesh) if not check.ok]
    assert not failed, failed
    mesh.destroy()
    rank = dist.get_rank()
    with pytest.raises(meshstate.ConfigError, match=r"the adopted 'dp' group of rank \d holds ranks \[\d, \d\], but the layout"):
        meshstate.adopt({"tp": tp, "dp": tp}, tp=2)  # every rank raises, none hangs
    dist.destroy_process_group(tp)
    dist.destroy_process_group(dp)
    assert rank == dist.get_rank()
