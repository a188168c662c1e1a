"""Shared test helpers: megatron-core's RankGenerator as the layout oracle."""

import warnings

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.parallel_state import RankGenerator

# meshstate kind -> (view, megatron-core RankGenerator token)
MEGATRON_TOKENS = {
    "tp": ("dense", "tp"),
    "cp": ("dense", "cp"),
    "dp": ("dense", "dp"),
    "pp": ("dense", "pp"),
    "tp-cp": ("dense", "tp-cp"),
    "dp-cp": ("dense", "dp-cp"),
    "tp-dp": ("dense", "tp-dp"),
    "tp-dp-cp": ("dense", "tp-dp-cp"),
    "tp-pp": ("dense", "tp-pp"),
    "ep": ("expert", "ep"),
    "etp": ("expert", "tp"),
    "etp-ep": ("expert", "tp-ep"),
    "etp-ep-pp": ("expert", "tp-ep-pp"),
    "edp": ("expert", "dp"),
}


def megatron_groups(config):
    """Every kind's groups as megatron-core's RankGenerator builds them for ``config``."""
    generators = {
        "dense": RankGenerator(
            tp=config.tp, ep=1, dp=config.dp, pp=config.pp, cp=config.cp, order=config.order
        ),
        "expert": RankGenerator(
            tp=config.etp, ep=config.ep, dp=config.edp, pp=config.pp, cp=1, order=config.order
        ),
    }
    return {
        kind: generators[view].get_ranks(token) for kind, (view, token) in MEGATRON_TOKENS.items()
    }


@pytest.fixture
def oracle():
    return megatron_groups
