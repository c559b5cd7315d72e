"""Local gradient accumulation between global steps: one flat float32 buffer, weighted by samples."""

from __future__ import annotations

import torch

from dedloc.numerics import all_finite


class GradientAccumulator:
    """Sums ``batch_size * grad`` over micro-batches for a fixed list of parameters.

    ``export()`` gives the vector averaged across peers: the local mean gradient followed by one
    unused entry (0; once an overflow flag, which let any member veto a step). When the local sum
    is not finite the gradient part is zeros, and the optimizer contributes it with weight 0.
    Weighted by local samples, the peers' mean of these vectors is exactly the gradient of the
    mean loss over every sample the collaboration processed for the step.
    """

    def __init__(self, params: list[torch.Tensor]):
        if not params:
            raise ValueError("the optimizer has no parameters that require gradients")
        self.params = params
        self.sizes = [p.numel() for p in params]
        self.numel = sum(self.sizes)
        self.device = params[0].device
        self.sum = torch.zeros(self.numel, dtype=torch.float32, device=self.device)
        self.samples = 0
        self.micro_batches = 0

    def add(self, batch_size: int, grad_scale: float = 1.0) -> None:
        """Add the parameters' current ``.grad`` (from a mean loss over ``batch_size`` samples)."""
        offset = 0
        alpha = batch_size / grad_scale
        for p, n in zip(self.params, self.sizes):
            if p.grad is not None:
                if p.grad.is_sparse:
                    raise ValueError("sparse gradients are not supported by the collaborative optimizer")
                self.sum[offset:offset + n].add_(p.grad.reshape(-1).to(self.sum.device, torch.float32),
                                                 alpha=alpha)
            offset += n
        self.samples += batch_size
        self.micro_batches += 1

    def export(self) -> tuple[torch.Tensor, bool]:
        """(vector of numel + 1 float32, finite) for averaging; a fresh tensor on the parameters' device
        (a CUDA vector then crosses to the host once, straight into the peer's shared buffer)."""
        out = torch.zeros(self.numel + 1, dtype=torch.float32, device=self.device)
        if self.samples == 0:
            return out, True
        mean = self.sum / self.samples
        finite = all_finite(mean)
        if finite:
            out[:-1].copy_(mean)
        return out, finite

    def load_grads(self, vector: torch.Tensor) -> None:
        """Write the first ``numel`` entries of ``vector`` into the parameters' ``.grad``."""
        offset = 0
        for p, n in zip(self.params, self.sizes):
            g = vector[offset:offset + n].view(p.shape).to(device=p.device, dtype=p.dtype)
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)
            offset += n

    def reset(self) -> None:
        self.sum.zero_()
        self.samples = 0
        self.micro_batches = 0
