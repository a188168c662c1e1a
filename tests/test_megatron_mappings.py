"""Plain-code collectives against megatron-core 0.16's tensor-parallel mappings, on 4 gloo ranks.

Outside shard_map, meshstate's named collectives take their input as varying
over the axes they name and use JAX's default transposes, which are Megatron's:
each rank's own ``backward()`` gives what megatron-core's autograd functions give.
The oracle is megatron-core itself (``megatron.core.tensor_parallel.mappings``),
run on the same group with the same inputs and upstream gradients.
"""

import contextlib
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import meshstate
from meshstate.jax import collectives as lax
from meshstate.testing import distributed


def megatron_mappings():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron-core's notes about Transformer Engine and Apex
        from megatron.core.tensor_parallel import mappings
    return mappings


@contextlib.contextmanager
def cpu_as_current_device():
    """What Megatron-LM's CPU tests do: its gathers allocate on ``torch.cuda.current_device()``,
    which answers the CPU here (and is given back afterwards: the worker serves other tests)."""
    current_device = torch.cuda.current_device
    torch.cuda.current_device = lambda: torch.device("cpu")
    try:
        yield
    finally:
        torch.cuda.current_device = current_device


PAIRS = {
    # name: (meshstate's call, megatron-core's call on group g)
    "psum = reduce_from_tensor_model_parallel_region": (
        lambda x: lax.psum(x, "tp"),
        lambda m, x, g: m.reduce_from_tensor_model_parallel_region(x, group=g)),
    "pvary = copy_to_tensor_model_parallel_region": (
        lambda x: lax.pvary(x, "tp"),
        lambda m, x, g: m.copy_to_tensor_model_parallel_region(x, group=g)),
    "all_gather_invariant(last dim) = gather_from_tensor_model_parallel_region": (
        lambda x: lax.all_gather_invariant(x, "tp", axis=-1, tiled=True),
        lambda m, x, g: m.gather_from_tensor_model_parallel_region(x, group=g)),
    "all_gather(dim 0) = gather_from_sequence_parallel_region": (
        lambda x: lax.all_gather(x, "tp", axis=0, tiled=True),
        lambda m, x, g: m.gather_from_sequence_parallel_region(x, group=g)),
    "all_gather_invariant(dim 0) = gather_from_sequence_parallel_region(output grad not parallel)": (
        lambda x: lax.all_gather_invariant(x, "tp", axis=0, tiled=True),
        lambda m, x, g: m.gather_from_sequence_parallel_region(
            x, tensor_parallel_output_grad=False, group=g)),
    "psum_scatter(dim 0) = reduce_scatter_to_sequence_parallel_region": (
        lambda x: lax.psum_scatter(x, "tp", scatter_dimension=0, tiled=True),
        lambda m, x, g: m.reduce_scatter_to_sequence_parallel_region(x, group=g)),
}


def forward_and_backward(call, rank):
    """``call``'s output and the input's gradient for an upstream gradient that differs by rank."""
    x = (torch.arange(24.0, dtype=torch.float64).view(8, 3) * (rank + 1)).requires_grad_()
    y = call(x)
    upstream = torch.arange(y.numel(), dtype=torch.float64).view(y.shape) + 10 * rank
    y.backward(upstream)
    return y.detach(), x.grad


@pytest.mark.parametrize("tp", [2, 4])
@distributed(world_size=4)
def test_collectives_equal_megatron_core_mappings(tp):
    mappings = megatron_mappings()
    mesh = meshstate.init_mesh(tp=tp)
    rank = dist.get_rank()
    with mesh, cpu_as_current_device():
        for name, (ours, megatrons) in PAIRS.items():
            y, grad = forward_and_backward(ours, rank)
            expected_y, expected_grad = forward_and_backward(
                lambda x: megatrons(mappings, x, mesh.group("tp")), rank)
            torch.testing.assert_close(y, expected_y, msg=f"{name}: forward")
            torch.testing.assert_close(grad, expected_grad, msg=f"{name}: backward")
    mesh.destroy()


BATCH, IN, HIDDEN, OUT, STEPS, LEARNING_RATE = 8, 6, 8, 4, 3, 0.1


def model_and_data():
    """The same full weights and batch on every rank (float64, so results compare exactly)."""
    generator = torch.Generator().manual_seed(0)
    weights = {
        "up": torch.randn(IN, HIDDEN, generator=generator, dtype=torch.float64),
        "down": torch.randn(HIDDEN, OUT, generator=generator, dtype=torch.float64),
    }
    x = torch.randn(BATCH, IN, generator=generator, dtype=torch.float64)
    target = torch.randn(BATCH, OUT, generator=generator, dtype=torch.float64)
    return weights, x, target


def train_single_process():
    """The weights after STEPS SGD steps, and the input's gradient at the first step."""
    weights, x, target = model_and_data()
    x_grads = []
    for _ in range(STEPS):
        params = {name: w.clone().requires_grad_() for name, w in weights.items()}
        inputs = x.clone().requires_grad_()
        loss = F.mse_loss(F.gelu(inputs @ params["up"]) @ params["down"], target)
        loss.backward()
        weights = {name: (p - LEARNING_RATE * p.grad).detach() for name, p in params.items()}
        x_grads.append(inputs.grad)
    return weights, x_grads[0]


@distributed(world_size=4)
def test_megatron_style_mlp_trains_like_one_process():
    """Column-parallel up, gelu, row-parallel down, psum over tp, in plain torch code; the batch
    split over dp. Three SGD steps, each rank's own backward(): the weights equal one process's."""
    mesh = meshstate.init_mesh(tp=2)  # dp=2
    tp, dp = mesh.rank("tp"), mesh.rank("dp")
    weights, x, target = model_and_data()
    columns = slice(tp * HIDDEN // 2, (tp + 1) * HIDDEN // 2)
    up, down = weights["up"][:, columns].clone(), weights["down"][columns].clone()
    rows = slice(dp * BATCH // 2, (dp + 1) * BATCH // 2)
    x_grads = []
    with mesh:
        for _ in range(STEPS):
            up.requires_grad_(), down.requires_grad_()
            inputs = x[rows].clone().requires_grad_()
            hidden = F.gelu(lax.pvary(inputs, "tp") @ up)      # copy_to_tensor_model_parallel_region
            y = lax.psum(hidden @ down, "tp")                  # reduce_from_tensor_model_parallel_region
            F.mse_loss(y, target[rows]).backward()             # the loss is replicated over tp
            x_grads.append(inputs.grad)
            with torch.no_grad():
                up = up - LEARNING_RATE * lax.pmean(up.grad, "dp")
                down = down - LEARNING_RATE * lax.pmean(down.grad, "dp")
    expected, expected_x_grad = train_single_process()
    torch.testing.assert_close(up, expected["up"][:, columns])
    torch.testing.assert_close(down, expected["down"][columns])
    # Each dp rank's loss is the mean over its half of the batch: twice the weight per row.
    torch.testing.assert_close(x_grads[0], 2 * expected_x_grad[rows])
    mesh.destroy()
