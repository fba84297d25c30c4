"""Eager's kernel where the captured operator has a slower one on the device.

Capture decomposes a module into the aten ops autograd records, and on CUDA one of
them runs a slower kernel than eager would: batch norm. Eager's ``batch_norm`` picks
cuDNN's kernels (``cudnn_batch_norm`` and its backward); the captured step holds the
portable ``_native_batch_norm_legit_functional`` and ``native_batch_norm_backward``,
whose CUDA kernels took 32.4 ms of ResNet-50's step at paper size on an H200 where
cuDNN's took 21.6 (torch.profiler, self CUDA time per step; the plan ran 1.20x eager's
time where the simulator said 1.01). :func:`runtime_kernel` gives the runtime each
such op's stand-in: the same results from eager's kernel where eager would use it, the
captured op everywhere else (on a CPU, always).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

aten = torch.ops.aten

#: cuDNN's smallest batch-norm epsilon (``CUDNN_BN_MIN_EPSILON``); eager falls back below it
CUDNN_MIN_EPSILON = 1e-5
#: the largest batch eager hands to cuDNN's training batch norm
CUDNN_MAX_BATCH = 880801


def _cudnn_eligible(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> bool:
    """Whether eager's ``batch_norm`` would train ``x`` with cuDNN's kernels (and in the
    ``SPATIAL`` mode, whose backward needs no reserve space: a contiguous NCHW input);
    the forward also needs a bias."""
    return (
        x.is_cuda
        and torch.backends.cudnn.enabled
        and torch.backends.cudnn.is_available()
        and weight is not None
        and weight.dtype == torch.float32
        and x.dtype in (torch.float32, torch.float16)
        and x.dim() >= 3
        and x.is_contiguous()
        and x.shape[0] <= CUDNN_MAX_BATCH
        and x.numel() < 2**31 - 1
        and eps >= CUDNN_MIN_EPSILON
    )


def batch_norm_forward(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    training: bool,
    momentum: float,
    eps: float,
) -> tuple[torch.Tensor, ...]:
    """``_native_batch_norm_legit_functional``: (output, mean, inverse std, updated running mean
    and variance), by cuDNN where eager would use it. The running statistics are updated in
    copies, as the functional op does (the step writes them back where the graph says)."""
    if not (training and bias is not None and _cudnn_eligible(x, weight, eps)):
        return aten._native_batch_norm_legit_functional.default(
            x, weight, bias, running_mean, running_var, training, momentum, eps
        )
    new_mean, new_var = running_mean.clone(), running_var.clone()
    out, mean, invstd, reserve = aten.cudnn_batch_norm.default(x, weight, bias, new_mean, new_var, True, momentum, eps)
    if reserve.numel():  # a mode whose backward reads the reserve, which the graph does not keep
        return aten._native_batch_norm_legit_functional.default(
            x, weight, bias, running_mean, running_var, training, momentum, eps
        )
    return out, mean, invstd, new_mean, new_var


def batch_norm_backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    save_mean: torch.Tensor | None,
    save_invstd: torch.Tensor | None,
    train: bool,
    eps: float,
    output_mask: list[bool],
) -> tuple[torch.Tensor | None, ...]:
    """``native_batch_norm_backward``, by cuDNN where eager would use it. Both kernels save the
    batch's mean and inverse standard deviation, so either backward reads either's."""
    cudnn = train and all(output_mask) and save_mean is not None and save_invstd is not None
    if not (cudnn and _cudnn_eligible(x, weight, eps)):
        return aten.native_batch_norm_backward.default(
            grad_out, x, weight, running_mean, running_var, save_mean, save_invstd, train, eps, output_mask
        )
    reserve = torch.empty(0, dtype=torch.uint8, device=x.device)
    return aten.cudnn_batch_norm_backward.default(
        x, grad_out.contiguous(), weight, running_mean, running_var, save_mean, save_invstd, eps, reserve
    )


_STAND_INS: dict[Any, Callable[..., Any]] = {
    aten._native_batch_norm_legit_functional.default: batch_norm_forward,
    aten.native_batch_norm_backward.default: batch_norm_backward,
}


def runtime_kernel(target: Any) -> Any:
    """What the runtime calls for ``target``: its stand-in (module docstring), else ``target``."""
    return _STAND_INS.get(target, target) if isinstance(target, torch._ops.OpOverload) else target
