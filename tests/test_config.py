"""Every validation error: its type and its message, raised before any process group."""

import pytest

from meshstate import ConfigError, MeshConfig
from meshstate.layout.config import parse_order

BAD_CONFIGS = [
    # (kwargs, exact message)
    (dict(world_size=12, tp=2, pp=8), "world size 12 is not divisible by tp*cp*pp = 2*1*8 = 16"),
    (dict(world_size=16, tp=2, cp=2, pp=2, ep=3, etp=1),
     "world size 16 is not divisible by etp*ep*pp = 1*3*2 = 6"),
    (dict(world_size=0), "world size must be a positive integer, got 0"),
    (dict(world_size=8, tp=0), "tp must be a positive integer, got 0"),
    (dict(world_size=8, cp=-2), "cp must be a positive integer, got -2"),
    (dict(world_size=8, ep=1.5), "ep must be a positive integer, got 1.5"),
    (dict(world_size=8, etp=0), "etp must be a positive integer, got 0"),
    (dict(world_size=8, pp=True), "pp must be a positive integer, got True"),
    (dict(world_size="8"), "world size must be a positive integer, got '8'"),
    (dict(world_size=8, order="tp-xp-dp"),
     "order 'tp-xp-dp' has unknown axis 'xp'; valid axes are tp, cp, ep, dp, pp"),
    (dict(world_size=8, order="tp-dp-tp"), "order 'tp-dp-tp' names axis 'tp' twice"),
    (dict(world_size=8, order="tp--dp"), "order 'tp--dp' has an empty axis name"),
    (dict(world_size=8, order=None), "order must be a string such as 'tp-cp-ep-dp-pp', got None"),
    (dict(world_size=8, cp=2, order="tp-dp-pp"), "cp=2 needs axis 'cp' in order 'tp-dp-pp'"),
    (dict(world_size=8, pp=2, order="tp-cp-ep-dp"),
     "pp=2 needs axis 'pp' in order 'tp-cp-ep-dp'"),
    (dict(world_size=8, ep=2, order="tp-cp-dp-pp"),
     "ep=2 needs axis 'ep' in order 'tp-cp-dp-pp'"),
    (dict(world_size=8, tp=2, order="cp-ep-dp-pp"),
     "tp=2 needs axis 'tp' in order 'cp-ep-dp-pp'"),
    (dict(world_size=8, tp=1, etp=2, order="cp-ep-dp-pp"),
     "etp=2 (expert layers use the 'tp' slot) needs axis 'tp' in order 'cp-ep-dp-pp'"),
    (dict(world_size=8, tp=2, order="tp-cp-ep-pp"),
     "dp=4 (world size 8 / tp*cp*pp = 2) needs axis 'dp' in order 'tp-cp-ep-pp'"),
    (dict(world_size=8, tp=2, cp=4, etp=1, order="tp-cp-ep-pp"),
     "edp=8 (world size 8 / etp*ep*pp = 1; expert layers use the 'dp' slot) "
     "needs axis 'dp' in order 'tp-cp-ep-pp'"),
    (dict(world_size=16, tp=2, pp=2, ep=2, order="tp-cp-ep-pp-dp"),
     "order 'tp-cp-ep-pp-dp' does not end with 'pp', which needs equal dense and expert "
     "data-parallel sizes, but dp = 4 and edp = 2"),
    (dict(world_size=8, cp=2, ep=2, etp=1, pp=2, order="tp-cp-pp-ep-dp"),
     "order 'tp-cp-pp-ep-dp' gives different pipeline groups to dense and expert layers: "
     "ranks one stage apart differ by tp*cp = 2 in dense layers but etp = 1 in expert "
     "layers; put 'pp' last"),
]


@pytest.mark.parametrize("kwargs, message", BAD_CONFIGS)
def test_bad_config_raises_config_error_with_numbers(kwargs, message):
    world_size = kwargs.pop("world_size")
    with pytest.raises(ConfigError) as raised:
        MeshConfig(world_size, **kwargs)
    assert str(raised.value) == message
    assert isinstance(raised.value, ValueError)


def test_defaults_infer_dp_and_etp():
    config = MeshConfig(32, tp=2, cp=2, pp=2, ep=4)
    assert config.order == "tp-cp-ep-dp-pp"
    assert config.etp == 2
    assert config.sizes() == {"tp": 2, "cp": 2, "ep": 4, "etp": 2, "pp": 2, "dp": 4, "edp": 2}


def test_config_is_a_value():
    assert MeshConfig(8, tp=2, etp=2) == MeshConfig(8, tp=2)
    assert hash(MeshConfig(8, tp=2)) == hash(MeshConfig(8, tp=2, etp=None))
    assert MeshConfig(8, tp=2) != MeshConfig(8, tp=4)


def test_order_is_lower_cased_and_missing_axes_appended_like_megatron():
    assert MeshConfig(8, tp=2, order="TP-dp-pp").order == "tp-dp-pp"
    assert parse_order("tp-dp-pp") == ("tp", "dp", "pp", "ep", "cp")
    assert parse_order("pp-dp") == ("pp", "dp", "tp", "ep", "cp")


def test_non_pp_last_order_is_fine_when_data_parallel_sizes_agree():
    config = MeshConfig(16, tp=2, pp=2, ep=2, etp=1, order="tp-ep-pp-dp")
    assert (config.dp, config.edp) == (4, 4)


def test_size_one_axes_may_be_left_out_of_the_order():
    assert MeshConfig(4, tp=4, order="tp").dp == 1


@pytest.mark.parametrize("order", [" tp-dp-pp", "tp -dp", "tp-dp-pp\n", "tp-\tdp"])
def test_order_with_spaces_is_refused_like_megatron(order):
    with pytest.raises(ConfigError, match="spaces"):
        MeshConfig(8, tp=2, order=order)


def test_any_integer_type_is_a_size_and_worlds_stop_at_two_to_the_31():
    import numpy as np

    config = MeshConfig(np.int64(8), tp=np.int64(2), pp=np.int32(2))
    assert (config.tp, config.pp, config.dp) == (2, 2, 2) and type(config.tp) is int
    assert MeshConfig(2**31 - 1).dp == 2**31 - 1
    with pytest.raises(ConfigError, match="world size 2147483648 is above 2147483647"):
        MeshConfig(2**31)
    for wrong in (2.0, True, "2", np.float64(2)):
        with pytest.raises(ConfigError, match="tp must be a positive integer"):
            MeshConfig(8, tp=wrong)
