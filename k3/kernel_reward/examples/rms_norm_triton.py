"""An honest RMSNorm candidate in Triton: one program per row, fp32 statistics (runs in Triton's interpreter on
CPU)."""

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm(x_ptr, w_ptr, y_ptr, D, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / D + eps)
    x_hat = (x * rstd).to(tl.bfloat16).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(y_ptr + row * D + cols, (w * x_hat).to(tl.bfloat16), mask=mask)


def kernel(x, weight, eps):
    x = x.contiguous()
    y = torch.empty_like(x)
    rows, D = x.shape
    if rows:
        _rms_norm[(rows,)](x, weight, y, D, eps, BLOCK=triton.next_power_of_2(D))
    return y
