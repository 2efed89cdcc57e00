"""BatchNorm statistics over the global batch under DDP on any device.

torch's SyncBatchNorm runs on CUDA only. On the CPU (gloo) this module computes the same
statistics from two differentiable all-reduces, of per-channel (sum, count) and then of the
squared deviations from the global mean:
autograd carries the gradient back through the reduction, as SyncBatchNorm's own backward does,
so DDP with synced BatchNorm trains like one process on the whole global batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn


def _sum_over_ranks(tensor: torch.Tensor) -> torch.Tensor:
    """all_reduce(SUM) with its gradient: every rank's output depends on every rank's input,
    so the gradient of a rank's input is the sum over ranks of the output gradients.

    The output is the reduced sum exactly, tied to `tensor` by a zero term (x − x) that
    carries the identity gradient; a hook on the output replaces its gradient by that
    gradient summed over ranks before it flows back into `tensor`.
    """
    total = tensor.detach().clone()
    dist.all_reduce(total)
    out = total + (tensor - tensor.detach())
    if out.requires_grad:
        out.register_hook(_summed_gradient)
    return out


def _summed_gradient(grad: torch.Tensor) -> torch.Tensor:
    grad = grad.contiguous().clone()
    dist.all_reduce(grad)
    return grad


BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


class GlobalBatchNorm(nn.BatchNorm2d):
    """BatchNorm (of 1d, 2d or 3d inputs) whose training statistics are summed over all ranks of the
    default group."""

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected an input of at least 2 dimensions (N, C, ...), got {x.dim()}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        centred, mean, var, n = global_moments(xf)
        if self.track_running_stats:  # then the three buffers are tensors (torch's _NormBase makes them)
            assert self.running_mean is not None and self.running_var is not None
            assert self.num_batches_tracked is not None
            with torch.no_grad():
                self.num_batches_tracked += 1
                factor = self.momentum if self.momentum is not None else 1 / float(self.num_batches_tracked)
                unbiased = var * (n / (n - 1).clamp_min(1))
                self.running_mean.lerp_(mean.to(self.running_mean.dtype), factor)
                self.running_var.lerp_(unbiased.to(self.running_var.dtype), factor)
        shape = (1, x.shape[1]) + (1,) * (x.dim() - 2)
        y = centred * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y.to(x.dtype)


def global_moments(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`x` (N, C, ...) minus its per-channel mean over all ranks; that mean, the (biased)
    variance and the count.

    Two passes, as one process's BatchNorm computes them: the mean first, then the mean of the
    squared deviations from it. The one-pass E[x²] − E[x]² loses the digits of mean²/var
    (cancellation): with mean 10⁴ × std, 8 of float64's 16 and all of float32's."""
    c = x.shape[1]
    dims, shape = (0, *range(2, x.dim())), (1, c) + (1,) * (x.dim() - 2)
    count = torch.full((1,), x.numel() / c, dtype=x.dtype, device=x.device)
    total = _sum_over_ranks(torch.cat([x.sum(dims), count]))
    n = total[-1]
    mean = total[:c] / n
    centred = x - mean.view(shape)
    var = _sum_over_ranks((centred * centred).sum(dims)) / n
    return centred, mean, var, n


GlobalBatchNorm2d = GlobalBatchNorm  # the name it had when it took 2d inputs only


def convert_global_batchnorm(module: nn.Module) -> nn.Module:
    """Replace every BatchNorm (1d, 2d, 3d) in `module` by GlobalBatchNorm, keeping its state, as
    torch's convert_sync_batchnorm does on GPUs."""
    if isinstance(module, BATCH_NORMS) and not isinstance(module, GlobalBatchNorm):
        new = GlobalBatchNorm(
            module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats
        )
        like = next(t for t in module.state_dict().values() if t.is_floating_point())
        new.to(device=like.device, dtype=like.dtype)
        new.load_state_dict(module.state_dict())
        new.train(module.training)
        return new
    for name, child in module.named_children():
        setattr(module, name, convert_global_batchnorm(child))
    return module
