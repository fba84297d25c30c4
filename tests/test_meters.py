"""The CPU allocator's meter (issue #30): it sees what Inductor's code allocates below the
dispatcher, where the live-tensor meter sees nothing, and keeps a Store's host copies apart."""

import pytest
import torch

from magis.backend.meter import CpuAllocatorMeter, LiveTensorMeter
from magis.backend.transfer import Load, Store

N = 256  # a float32 N x N matrix is 256 KiB


def chain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return ((x @ w).relu() @ w).sin().sum()


@pytest.fixture(scope="module")
def operands() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(N, N), torch.randn(N, N)


def test_the_allocator_meter_reads_eager_ops_as_the_live_tensor_meter_does(operands):
    with CpuAllocatorMeter(operands) as allocator:
        chain(*operands)
    with LiveTensorMeter(operands) as live:
        chain(*operands)
    assert allocator.resident_bytes == 2 * N * N * 4
    figures = (allocator.peak_bytes, live.peak_bytes)
    assert abs(allocator.peak_bytes - live.peak_bytes) <= 0.01 * live.peak_bytes, figures


def test_the_allocator_meter_sees_the_buffers_of_inductors_code(operands):
    compiled = torch.compile(chain)
    compiled(*operands)  # compiles
    with CpuAllocatorMeter() as allocator:
        compiled(*operands)
    with torch.no_grad(), CpuAllocatorMeter() as eager:
        chain(*operands)
    matrix = N * N * 4
    # its matmuls write two N x N buffers (the relu and sin fused into them), alive together
    assert 2 * matrix <= allocator.peak_bytes <= eager.peak_bytes, (allocator.peak_bytes, eager.peak_bytes)


def test_a_stores_host_copy_is_offloaded_not_device_memory(operands):
    x = operands[0].clone()
    with CpuAllocatorMeter([x]) as meter:
        host = Store(x.nbytes)(x)
        back = Load(x.nbytes)(host)
        del host
    assert torch.equal(back, x)
    assert meter.offloaded_bytes == x.nbytes
    assert meter.peak_bytes == 2 * x.nbytes  # x and what the Load made of it, not the host copy


def test_the_allocator_meter_does_not_nest_inside_a_running_profiler():
    with torch.profiler.profile(), pytest.raises(RuntimeError, match="already running"), CpuAllocatorMeter():
        pass
