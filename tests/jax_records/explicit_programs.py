"""The programs ``tests/test_explicit.py`` runs in meshstate's explicit mode and
``record_explicit.py`` runs in JAX's (Explicit axes, under ``jax.jit``): plain
Python over a namespace each side fills with its own functions, so both run the
same text. Imports nothing, so JAX's virtual environment and torch's read it alike.

The mesh: 8 devices as ``(pp, dp, cp, tp) = (1, 2, 1, 4)``, device ``i`` at the
``i``-th coordinate in row-major order (meshstate's ``init_mesh(tp=4)`` dense view).
The namespace holds the inputs of :data:`INPUTS` (replicated, unsharded) and:

- ``S(*dims, unreduced=())``: a partition spec; ``put(a, spec)``: ``a`` laid out as
  ``spec`` says (JAX: ``reshard`` of a replicated value, inside ``jit``);
  ``reshard(a, spec)``;
- ``matmul(a, b, out=None)``, ``einsum(equation, *operands, out=None)``: ``out``
  is the ``out_sharding``;
- ``sum``, ``mean``, ``amax`` as ``(a, dims, keepdim=False)``; ``sin``, ``exp``,
  ``tanh``, ``gelu`` (tanh approximation), ``maximum``; ``permute(a, dims)``,
  ``unsqueeze(a, dim)``, ``cat(operands, dim)``, ``cast(a, dtype_name)``;
- ``auto(f, out)``: JAX's ``auto_axes(f, out_sharding=out)``; ``explicit(f, into)``:
  ``explicit_axes(f, in_sharding=into)``.

Each program assigns ``out``; the record keeps its type, global value and each
device's shard, or the error JAX raised.
"""

MESH_SHAPE = (1, 2, 1, 4)
MESH_AXES = ("pp", "dp", "cp", "tp")

INPUTS = {
    "x": ((8, 16), "float32"),
    "y": ((8, 16), "float32"),
    "w": ((16, 4), "float32"),
    "v": ((16, 8), "float32"),
    "b": ((16,), "float32"),
    "r": ((8, 1), "float32"),
    "t": ((2, 8, 16), "float32"),
    "q": ((2, 16, 4), "float32"),
    "n": ((8, 16), "int32"),
}


def input_values(number, size):
    """The flat values of the ``number``-th input of ``size`` elements: quarters in
    [-1.5, 1.5], exact in every float dtype; the int input takes the numerators."""
    return [((i * 7 + 3 * number) % 13 - 6) / 4 for i in range(size)]


def int_values(number, size):
    return [(i * 7 + 3 * number) % 13 - 6 for i in range(size)]


XD = 'a = put(x, S("dp", "tp")); wt = put(w, S("tp", None)); '
"""An (8,16) value split on both dims and a weight split on its rows: their matmul
contracts a dim split on both sides."""
U = XD + 'u = matmul(a, wt, out=S("dp", None, unreduced={"tp"})); '
"""... and ``u``, their product as a pending sum over tp, ``float32[8@dp,4]{U:tp}``."""

PROGRAMS = {
    # 33. types
    "type_two_axes": 'out = put(x, S("dp", "tp"))',
    "type_joint": 'out = put(x, S(("dp", "tp"), None))',
    "type_joint_against_mesh_order": 'out = put(x, S(("tp", "dp")))',
    "type_size_one_axis": 'out = put(x, S("pp", "tp"))',
    "type_short_spec": 'out = put(x, S("dp"))',
    "type_replicated": "out = put(x, S())",
    "type_zero_dims": 'out = sum(put(x, S()), (0, 1))',
    "type_int32": 'out = put(n, S("dp", "tp"))',
    "type_bfloat16": 'out = put(cast(x, "bfloat16"), S("dp", "tp"))',
    "type_unreduced": 'out = put(x, S("dp", None, unreduced={"tp"}))',
    "type_unreduced_two_axes": 'out = put(x, S(None, None, unreduced={"dp", "tp"}))',
    # 34. elementwise
    "add_same": 'out = put(x, S("dp", "tp")) + put(y, S("dp", "tp"))',
    "add_dims_from_each": 'out = put(x, S("dp", None)) + put(y, S(None, "tp"))',
    "mul_replicated": 'out = put(x, S("dp", "tp")) * put(y, S())',
    "scalars": 'out = put(x, S("dp", "tp")) * 2.0 + 1.0',
    "sub_zero_dim": 'out = put(x, S("dp", "tp")) - sum(put(y, S()), (0, 1))',
    "div": 'out = put(x, S(("dp", "tp"), None)) / put(y, S(("dp", "tp"), None))',
    "broadcast_row": 'out = put(x, S("dp", "tp")) + put(b, S("tp"))',
    "broadcast_replicated_row": 'out = put(x, S("dp", "tp")) + put(b, S())',
    "broadcast_column": 'out = put(x, S("dp", "tp")) * put(r, S("dp", None))',
    "broadcast_into_replicated": 'out = put(x, S()) + put(b, S("tp"))',
    "maximum": 'out = maximum(put(x, S("dp", None)), put(y, S("dp", None)))',
    "sin": 'out = sin(put(x, S("dp", "tp")))',
    "exp_tanh": 'out = exp(tanh(put(x, S(None, "tp"))))',
    "neg": 'out = -put(x, S("dp", "tp"))',
    "add_refused_different_axes": 'out = put(x, S("dp", None)) + put(y, S("tp", None))',
    "mul_refused_swapped": 'out = put(x, S("dp", "tp")) * put(y, S("tp", "dp"))',
    "add_refused_joint_against_one": 'out = put(x, S(("dp", "tp"), None)) + put(y, S("dp", None))',
    "add_refused_axis_twice": 'out = put(x, S("dp", None)) + put(y, S(None, "dp"))',
    # 35. matmul and einsum
    "matmul_free_dims": 'out = put(x, S("dp", None)) @ put(w, S(None, "tp"))',
    "matmul_contracting_lhs_only": 'out = put(x, S("dp", "tp")) @ put(w, S())',
    "matmul_contracting_rhs_only": 'out = put(x, S("dp", None)) @ put(w, S("tp", None))',
    "matmul_refused_contracting_both": XD + "out = a @ wt",
    "matmul_out_replicated": XD + 'out = matmul(a, wt, out=S("dp", None))',
    "matmul_out_reduce_scattered": XD + 'out = matmul(a, wt, out=S("dp", "tp"))',
    "matmul_out_all_replicated": XD + "out = matmul(a, wt, out=S())",
    "matmul_out_unreduced": U + "out = u",
    "matmul_refused_wrong_unreduced": XD + 'out = matmul(a, wt, out=S(None, None, unreduced={"dp"}))',
    "matmul_refused_inconsistent": 'out = put(x, S(None, "dp")) @ put(w, S("tp", None))',
    "matmul_refused_free_dims_one_axis": 'out = put(x, S("tp", None)) @ put(w, S(None, "tp"))',
    "matmul_vector": 'out = put(x, S("dp", None)) @ put(b, S())',
    "matmul_batched": 'out = put(t, S("dp", None, None)) @ put(q, S("dp", None, "tp"))',
    "matmul_refused_batch_one_side": 'out = put(t, S("dp", None, None)) @ put(q, S())',
    "einsum_free_dims": 'out = einsum("ij,jk->ik", put(x, S("dp", None)), put(w, S(None, "tp")))',
    "einsum_transposed": 'out = einsum("ji,jk->ik", put(v, S(None, "dp")), put(w, S(None, "tp")))',
    "einsum_out": XD + 'out = einsum("ij,jk->ik", a, wt, out=S("dp", None))',
    "einsum_out_unreduced": XD + 'out = einsum("ij,jk->ik", a, wt, out=S("dp", None, unreduced={"tp"}))',
    "einsum_refused_contracting_both": XD + 'out = einsum("ij,jk->ik", a, wt)',
    "einsum_batch_one_side": 'out = einsum("bij,bjk->bik", put(t, S("dp", None, None)), put(q, S()))',
    # 36. reductions
    "sum_split_dim": 'out = sum(put(x, S("dp", "tp")), 0)',
    "sum_unsplit_dim": 'out = sum(put(x, S("dp", None)), 1)',
    "sum_all": 'out = sum(put(x, S("dp", "tp")), (0, 1))',
    "sum_keepdim": 'out = sum(put(x, S("dp", "tp")), 0, keepdim=True)',
    "sum_joint": 'out = sum(put(x, S(("dp", "tp"), None)), 0)',
    "sum_method": 'out = put(x, S("dp", "tp")).sum(1)',
    "mean_split_dim": 'out = mean(put(x, S("dp", "tp")), 1)',
    "mean_all": 'out = mean(put(t, S("dp", None, "tp")), (0, 2))',
    "amax_split_dim": 'out = amax(put(x, S("dp", "tp")), 0)',
    "amax_keepdim": 'out = amax(put(x, S(("dp", "tp"), None)), 0, keepdim=True)',
    # 37. reshape
    "reshape_merge_split_dims": 'out = put(x, S("dp", "tp")).reshape(128)',
    "reshape_merge_leading_split": 'out = put(x, S("dp", None)).reshape(128)',
    "reshape_minus_one": 'out = put(x, S("dp", None)).reshape(-1)',
    "reshape_merge_trailing": 'out = put(t, S("dp", None, None)).reshape(2, 128)',
    "reshape_refused_unsplit_first": 'out = put(x, S(None, "tp")).reshape(128)',
    "reshape_refused_regroup": 'out = put(x, S("dp", "tp")).reshape(16, 8)',
    "reshape_split": 'out = put(x, S("dp", "tp")).reshape(8, 4, 4)',
    "reshape_split_joint": 'out = put(x, S(("dp", "tp"), None)).reshape(2, 4, 16)',
    "reshape_round_trip": 'out = put(x, S("dp", "tp")).reshape(128).reshape(8, 16)',
    "reshape_unchanged": 'out = put(x, S("dp", "tp")).reshape(8, 16)',
    # 38. transpose, unsqueeze, cat, slices
    "transpose": 'out = put(x, S("dp", "tp")).T',
    "permute": 'out = permute(put(t, S("dp", None, "tp")), (2, 0, 1))',
    "unsqueeze": 'out = unsqueeze(put(x, S("dp", "tp")), 1)',
    "cat_unsplit_dim": 'out = cat([put(x, S("dp", None)), put(y, S("dp", None))], 1)',
    "cat_split_dim": 'out = cat([put(x, S("dp", "tp")), put(y, S("dp", "tp"))], 0)',
    "cat_refused_different": 'out = cat([put(x, S("dp", None)), put(y, S())], 0)',
    "slice_unsplit_dim": 'out = put(x, S("dp", None))[:, 2:10]',
    "slice_split_dim": 'out = put(x, S("dp", "tp"))[:, 0:8]',
    "slice_split_dim_offset": 'out = put(x, S("dp", "tp"))[4:8]',
    "slice_refused_indivisible": 'out = put(x, S("dp", "tp"))[:, 0:6]',
    "index_unsplit_dim": 'out = put(x, S("dp", None))[:, 3]',
    # 39. reshard and pending sums
    "reshard_moves": 'out = reshard(put(x, S("dp", "tp")), S("tp", "dp"))',
    "reshard_into_unreduced": 'out = reshard(put(x, S("dp", "tp")), S("dp", None, unreduced={"tp"}))',
    "reshard_into_unreduced_unsplit": 'out = reshard(put(x, S()), S(None, "tp", unreduced={"dp"}))',
    "reshard_all_reduces": U + 'out = reshard(u, S("dp", None))',
    "reshard_reduce_scatters": U + 'out = reshard(u, S("dp", "tp"))',
    "unreduced_add": U + 'u2 = matmul(a, wt * 2.0, out=S("dp", None, unreduced={"tp"})); out = u + u2',
    "unreduced_sum": U + "out = sum(u, 0)",
    "unreduced_sum_free": U + "out = sum(u, 1)",
    "unreduced_transpose": U + "out = u.T",
    "unreduced_cat": U + "out = cat([u, u], 1)",
    "unreduced_reshape_split": U + "out = u.reshape(8, 2, 2)",
    "unreduced_refused_add_reduced": U + 'out = u + put(r, S("dp", None))',
    "unreduced_refused_scale": U + "out = u * 2.0",
    "unreduced_refused_square": U + "out = u * u",
    "unreduced_refused_matmul": U + 'out = u @ put(w[:4], S())',
    "unreduced_refused_sin": U + "out = sin(u)",
    # auto_axes and explicit_axes
    "auto_axes": XD + 'out = auto(lambda p, o: p @ o, S("dp", None))(a, wt)',
    "auto_axes_then_typed": XD + 'out = auto(lambda p, o: p @ o, S("dp", "tp"))(a, wt) + a[:, 0:4]',
    "explicit_axes_inside_auto": (
        'a = put(x, S("dp", "tp")); '
        'out = auto(lambda p: explicit(lambda e: sum(e, 0), S("dp", "tp"))(p), S("tp"))(a)'
    ),
}
