"""Group creation chosen once: split where the backend can, member-local where its split raises."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import meshstate
from meshstate.core import compat
from meshstate.errors import ConfigError, MeshStateError
from meshstate.testing import distributed, fake_world
from meshstate.tools.verify import verify_mesh


class _NoSplitBackend:
    """Pretend the default group is bound to a device and its backend cannot split."""

    def __init__(self) -> None:
        self.split_calls = 0
        self._saved = (compat.bound_device, dist.split_group)

    def __enter__(self) -> "_NoSplitBackend":
        def split_group(*args: object, **kwargs: object) -> None:
            self.split_calls += 1
            raise RuntimeError("this backend does not support comm splitting")

        compat.bound_device = lambda group: torch.device("cpu")
        dist.split_group = split_group
        return self

    def __exit__(self, *exc_info: object) -> None:
        compat.bound_device, dist.split_group = self._saved


def test_auto_falls_back_to_member_local_after_one_failed_split():
    with fake_world(5, 16), _NoSplitBackend() as backend:
        mesh = meshstate.init_mesh(tp=2, pp=2)
        assert backend.split_calls == 1
        assert mesh.ranks("dp") == (1, 3, 5, 7)
        assert mesh.process_groups.creation_calls == len(mesh.process_groups.owned)
        mesh.destroy()


def test_forced_split_names_the_fix_and_forced_local_never_splits():
    with fake_world(5, 16), _NoSplitBackend() as backend:
        with pytest.raises(MeshStateError, match="could not be split .* pass group_creation='local'"):
            meshstate.init_mesh(tp=2, pp=2, group_creation="split")
        calls = backend.split_calls
        meshstate.init_mesh(tp=2, pp=2, group_creation="local").destroy()
        assert backend.split_calls == calls
        with pytest.raises(ConfigError, match="group_creation must be 'split', 'local' or None"):
            meshstate.init_mesh(tp=2, group_creation="nccl")  # type: ignore[arg-type]


@distributed(world_size=4)
def test_no_split_gloo_world_builds_and_verifies_every_group():
    with _NoSplitBackend() as backend:
        mesh = meshstate.init_mesh(tp=2, ep=2, etp=1)
        assert backend.split_calls == 1
        failed = [(check.key, check.problems) for check in verify_mesh(mesh) if not check.ok]
        assert not failed, failed
        mesh.destroy()


@distributed(world_size=8, timeout=timedelta(seconds=30))
def test_a_group_only_some_ranks_made_leaves_later_groups_agreeing():
    """A joint group made on first use by the members of a sub-mesh only must not shift
    what the next collectively made group is called on those ranks (it used to: they
    then waited for each other under different names until the timeout)."""
    from meshstate.core.groups import create_group_family
    from meshstate.jax import collectives as lax

    rank = dist.get_rank()
    odd = meshstate.make_mesh((2, 2), ("x", "y"), ranks=[1, 3, 5, 7])
    if odd is not None:
        with odd:
            assert lax.psum(torch.ones(1), "x-y").item() == 4  # an undeclared axis set
        odd.destroy()
    family = [[0, 1, 2, 3], [4, 5, 6, 7]]
    group = create_group_family(family, description="after")
    total = torch.ones(1)
    dist.all_reduce(total, group=group)
    assert total.item() == 4 and dist.get_process_group_ranks(group) == family[rank // 4]
    dist.destroy_process_group(group)
