"""bitsandbytes 0.41.1's 4-bit linear layer, as LitGPT's published QLoRA runs trained it, on fake tensors.

    from workbench.studies.ladder.bnb_041 import quantize_linears
    quantize_linears(model, double_quant=True)    # every nn.Linear, the LM head included

LitGPT's resource tables (commit 8641822) were measured with bitsandbytes 0.41.1 under Lightning
2.1.0rc0's `BitsandbytesPrecision` (`--quantize bnb.nf4` or `bnb.nf4-dq`, dtype bf16). Today's
bitsandbytes trains a 4-bit layer another way (one fused `gemm_4bit`, saving no input), so
simulating those runs with it would predict another program. This is what 0.41.1 did, read from its
source (tag 18e827d6 "Version 0.41.1": `autograd/_functions.py` MatMul4Bit and matmul_4bit,
`functional.py` quantize_4bit / dequantize_4bit / dequantize_blockwise, `nn/modules.py` Linear4bit)
and from the plugin (Lightning 71aed751, the commit LitGPT 8641822 pinned:
`fabric/plugins/precision/bitsandbytes.py`):

- The plugin replaces the class `torch.nn.Linear` while the model is built, so every linear layer
  is 4-bit, the LM head included, and quantizes each weight from fp16 (`weight.half()`): the
  quantization state's dtype, which dequantization returns, is fp16.
- Kept per layer: the packed weight (uint8, (n + 1) // 2 x 1), the 16-value NF4 table (fp32);
  nf4: one fp32 absmax per 64 values; nf4-dq: those absmax as uint8, their mean (an fp32 scalar)
  and one fp32 absmax per 256 of them. Left out: double quantization's 256-value dynamic map, one
  per process (1 KiB).
- Forward (`matmul_4bit` -> `MatMul4Bit.forward`): dequantize the weight (nf4-dq first
  dequantizes its absmax to a new fp32 tensor and adds the mean in place), cast it to the input's
  dtype, `F.linear`; keep the input and the packed weight for backward when either needs a
  gradient (as attributes of the context, not saved tensors).
- Backward: dequantize again, cast to the gradient's dtype, matmul: the input's gradient only.

Nothing here is tuned to a published figure: the shapes, dtypes and lifetimes are the source's.
"""

from __future__ import annotations

import torch

BLOCKSIZE = 64  # quantize_4bit's default, which the plugin kept
NESTED_BLOCKSIZE = 256  # quantize_4bit(compress_statistics=True) quantizes the absmax in blocks of 256


class MatMul4Bit041(torch.autograd.Function):
    """bitsandbytes 0.41.1's MatMul4Bit: dequantize, cast, linear; the input kept for backward."""

    @staticmethod
    def forward(ctx, A, B, layer, bias):
        output = torch.nn.functional.linear(A, layer.dequantize().to(A.dtype), bias)
        ctx.layer = layer
        ctx.tensors = (A, B) if any(ctx.needs_input_grad[:2]) else (None, None)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        grad_A = None
        if ctx.needs_input_grad[0]:
            grad_A = torch.matmul(grad_output, ctx.layer.dequantize().to(grad_output.dtype))
        return grad_A, None, None, None


class Linear4bit041(torch.nn.Module):
    """A linear layer's 4-bit weight and quantization state as bitsandbytes 0.41.1 kept them."""

    def __init__(self, in_features: int, out_features: int, bias: torch.nn.Parameter | None, *,
                 double_quant: bool, compute_dtype: torch.dtype, device: torch.device | str | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.double_quant, self.compute_dtype = double_quant, compute_dtype
        self.quant_dtype = torch.float16  # the plugin quantized weight.half()
        n = in_features * out_features
        blocks = -(-n // BLOCKSIZE)
        f32 = dict(dtype=torch.float32, device=device)
        self.weight = torch.nn.Parameter(torch.empty(((n + 1) // 2, 1), dtype=torch.uint8, device=device),
                                         requires_grad=False)
        self.bias = bias
        if double_quant:
            self.register_buffer("absmax", torch.empty(blocks, dtype=torch.uint8, device=device), persistent=False)
            self.register_buffer("offset", torch.empty((), **f32), persistent=False)
            self.register_buffer("absmax2", torch.empty(-(-blocks // NESTED_BLOCKSIZE), **f32), persistent=False)
        else:
            self.register_buffer("absmax", torch.empty(blocks, **f32), persistent=False)
        self.register_buffer("code", torch.empty(16, **f32), persistent=False)  # get_4bit_type("nf4")

    def dequantize(self) -> torch.Tensor:
        """functional.dequantize_4bit: a new out_features x in_features tensor in the quantization dtype."""
        if self.double_quant:  # dequantize_blockwise(absmax, state2) + offset, alive until the weight is out
            absmax = torch.empty(self.absmax.shape, dtype=torch.float32, device=self.absmax.device)
            absmax += self.offset
        return torch.empty((self.out_features, self.in_features), dtype=self.quant_dtype, device=self.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inp_dtype = x.dtype
        x = x.to(self.compute_dtype)
        bias = None if self.bias is None else self.bias.to(self.compute_dtype)
        return MatMul4Bit041.apply(x, self.weight, self, bias).to(inp_dtype)


def quantize_linears(model: torch.nn.Module, *, double_quant: bool, compute_dtype: torch.dtype = torch.bfloat16) -> int:
    """Replace every `torch.nn.Linear` of `model` (on the meta device) by its 0.41.1 4-bit twin, in
    place, keeping its bias (frozen); returns how many were replaced."""
    n = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear:
                bias = child.bias
                if bias is not None:
                    bias.requires_grad_(False)
                setattr(module, name, Linear4bit041(child.in_features, child.out_features, bias,
                                                    double_quant=double_quant, compute_dtype=compute_dtype,
                                                    device=child.weight.device))
                n += 1
    return n
