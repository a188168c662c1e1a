"""megatron-core's getters of global ranks: the first rank of a group, the pipeline's
stages and neighbours, and ``get_all_ranks``; answered by the mesh served, as
:mod:`~meshstate.megatron.getters` answers.

Example, on rank 5 of 8 after ``initialize_model_parallel(tensor_model_parallel_size=2,
pipeline_model_parallel_size=2)``::

    get_tensor_model_parallel_src_rank(), get_pipeline_model_parallel_prev_rank()   # (4, 1)
"""

from __future__ import annotations

from meshstate.megatron import getters

__all__ = [
    "get_all_ranks", "get_data_parallel_src_rank", "get_expert_model_parallel_src_rank",
    "get_model_parallel_src_rank", "get_pipeline_model_parallel_first_rank",
    "get_pipeline_model_parallel_last_rank", "get_pipeline_model_parallel_next_rank",
    "get_pipeline_model_parallel_prev_rank", "get_tensor_model_parallel_src_rank",
]


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of the first member of the caller's tensor-parallel group."""
    return getters._facts.tp_ranks[0]


def get_model_parallel_src_rank() -> int:
    """Global rank of the first member of the caller's model-parallel group."""
    return getters._facts.tp_pp_ranks[0]


def get_data_parallel_src_rank(with_context_parallel: bool = False) -> int:
    """Global rank of the first member of the caller's data-parallel group."""
    facts = getters._facts
    return (facts.dp_cp_ranks if with_context_parallel else facts.dp_ranks)[0]


def get_expert_model_parallel_src_rank() -> int:
    """Global rank of the first member of the caller's expert-parallel group."""
    return getters._facts.ep_ranks[0]


def get_pipeline_model_parallel_first_rank() -> int:
    """Global rank of the first stage of the caller's pipeline."""
    return getters._facts.pp_ranks[0]


def get_pipeline_model_parallel_last_rank() -> int:
    """Global rank of the last stage of the caller's pipeline."""
    facts = getters._facts
    return facts.pp_ranks[facts.pp_size - 1]


def get_pipeline_model_parallel_next_rank() -> int:
    """Global rank of the next stage of the caller's pipeline (wrapping around)."""
    facts = getters._facts
    return facts.pp_ranks[(facts.pp_rank + 1) % facts.pp_size]


def get_pipeline_model_parallel_prev_rank() -> int:
    """Global rank of the previous stage of the caller's pipeline (wrapping around)."""
    facts = getters._facts
    return facts.pp_ranks[(facts.pp_rank - 1) % facts.pp_size]


def get_all_ranks() -> str:
    """The caller's tp, GTP, dp, cp, pp and ep ranks as ``"tp_gtp_dp_cp_pp_ep"``."""
    ranks = (getters.get_tensor_model_parallel_rank(), getters._facts.maybe.gtp_rank,
             getters.get_data_parallel_rank(), getters.get_context_parallel_rank(),
             getters.get_pipeline_model_parallel_rank(), getters.get_expert_model_parallel_rank())
    return "_".join(str(rank or 0) for rank in ranks)
