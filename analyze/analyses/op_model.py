"""FLOPs and bytes of one CPU op from the shapes `record_shapes=True` writes (Input Dims, Input type,
Concrete Inputs), with the standard formulas. An op, shape or argument the formulas do not cover gives
None, never a guess.

Sources of the formulas (each function names its own):
- GEMM: 2·M·N·K multiply-adds, + M·N for a bias/`beta·C` term (TraceLens `PerfModel/perf_model.py`
  `GEMM.flops_func`; PyTorch `torch/utils/flop_counter.py` `mm_flop`, `addmm_flop`, `bmm_flop`,
  `baddbmm_flop`). Bytes: each operand read once and the output written once (TraceLens `GEMM.bytes_func`),
  with the real shape of the added term.
- Convolution: 2 · prod(output shape) · prod(weight shape[1:]) (weight[1] = C_in / groups), + prod(output)
  for the bias; output size floor((in + 2p − d(k−1) − 1)/s) + 1 (PyTorch `torch.nn.Conv2d` docs;
  `flop_counter.py` `conv_flop_count`; TraceLens `CONV`). Transposed: 2 · prod(input) · prod(weight[1:]).
  Backward: one forward-sized convolution per requested gradient (input, weight), bias grad prod(output)
  (`flop_counter.py` `conv_backward_flop`).
- Attention (SDPA, flash, memory-efficient, cuDNN): forward 2·B·H_q·N_q·N_kv·(d_qk + d_v) (Q·Kᵀ and P·V;
  softmax left out); backward 2·B·H_q·N_q·N_kv·(3·d_qk + 2·d_v): the scores recomputed, dV, dP, dQ, dK
  (`flop_counter.py` `sdpa_flop_count`, `sdpa_backward_flop_count`). Causal masking halves both (only
  N_q = N_kv; Dao-AILab flash-attention `benchmarks/benchmark_flash_attention.py` `flops(..., causal)`;
  TraceLens `SDPA.flops_func`). Bytes: Q, K, V read and O written (backward: Q, K, V, dO read; dQ, dK, dV written).
- Elementwise: one FLOP per output element (TraceLens `UnaryElementwise`, `BinaryElementwise`), copies
  none; bytes = every tensor input read + the (broadcast) output written.
- Normalization (layer, RMS, batch, group norm): bytes = input read, output written, weight and bias
  read (TraceLens `Normalization`); FLOPs left unknown: they are bytes-bound and no standard count exists.
- Softmax: bytes = input read + output (same shape) written; FLOPs unknown for the same reason.
"""

from __future__ import annotations

import functools
import json
import math
import re

# Bytes per element of the 'Input type' names c10 writes (TraceLens utils.name2bpe, plus the fnuz/e8m0 fp8s).
ELEMENT_BYTES = {
    "double": 8, "long int": 8, "c10::complex<float>": 8,
    "float": 4, "int": 4,
    "c10::Half": 2, "c10::BFloat16": 2, "short int": 2,
    "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1, "c10::Float8_e4m3fnuz": 1, "c10::Float8_e5m2fnuz": 1,
    "c10::Float8_e8m0fnu": 1, "signed char": 1, "unsigned char": 1, "bool": 1,
}
# The dtype names of the peak table (analyze/analyses/devices.py).
DTYPE_NAMES = {"c10::BFloat16": "bf16", "c10::Half": "fp16", "float": "fp32", "double": "fp64",
               "c10::Float8_e4m3fn": "fp8", "c10::Float8_e5m2": "fp8", "c10::Float8_e4m3fnuz": "fp8",
               "c10::Float8_e5m2fnuz": "fp8"}

GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::linear", "aten::matmul"}
CONV_OPS = {"aten::convolution", "aten::_convolution", "aten::conv1d", "aten::conv2d", "aten::conv3d",
            "aten::convolution_backward"}
# Attention op -> (tensor layout of q/k/v, index of is_causal in Concrete Inputs, backward), from the ops'
# schemas in PyTorch's aten/src/ATen/native/native_functions.yaml. (_efficient_attention_forward is left
# out: its mask is an integer custom_mask_type, not is_causal.)
# Layouts: BHND = [batch, heads, seq, head_dim] (SDPA), BNHD = [batch, seq, heads, head_dim] (flash-attn).
ATTENTION_OPS = {
    "aten::scaled_dot_product_attention": ("BHND", 5, False),
    "aten::_scaled_dot_product_flash_attention": ("BHND", 4, False),
    "aten::_scaled_dot_product_efficient_attention": ("BHND", 6, False),
    "aten::_scaled_dot_product_cudnn_attention": ("BHND", 6, False),
    "aten::_flash_attention_forward": ("BNHD", 8, False),
    "aten::_scaled_dot_product_flash_attention_backward": ("BHND", 11, True),
    "aten::_scaled_dot_product_efficient_attention_backward": ("BHND", 11, True),
    "aten::_scaled_dot_product_cudnn_attention_backward": ("BHND", 14, True),
    "aten::_flash_attention_backward": ("BNHD", 11, True),
}
UNARY_OPS = {"aten::relu", "aten::relu_", "aten::gelu", "aten::gelu_", "aten::silu", "aten::silu_", "aten::sigmoid",
             "aten::sigmoid_", "aten::tanh", "aten::tanh_", "aten::exp", "aten::exp_", "aten::log", "aten::neg",
             "aten::sqrt", "aten::rsqrt", "aten::abs", "aten::reciprocal", "aten::square", "aten::sin", "aten::cos",
             "aten::erf", "aten::clamp", "aten::clamp_", "aten::hardtanh", "aten::leaky_relu", "aten::elu"}
BINARY_OPS = {"aten::add", "aten::add_", "aten::sub", "aten::sub_", "aten::rsub", "aten::mul", "aten::mul_", "aten::div",
              "aten::div_", "aten::maximum", "aten::minimum", "aten::pow", "aten::eq", "aten::ne", "aten::lt", "aten::le",
              "aten::gt", "aten::ge", "aten::gelu_backward", "aten::silu_backward", "aten::threshold_backward",
              "aten::sigmoid_backward", "aten::tanh_backward", "aten::masked_fill", "aten::masked_fill_"}
COPY_OPS = {"aten::copy_", "aten::clone", "aten::contiguous", "aten::_to_copy"}
NORM_OPS = {"aten::layer_norm", "aten::native_layer_norm", "aten::rms_norm", "aten::_fused_rms_norm",
            "aten::batch_norm", "aten::native_batch_norm", "aten::_batch_norm_impl_index", "aten::cudnn_batch_norm",
            "aten::group_norm", "aten::native_group_norm"}
SOFTMAX_OPS = {"aten::softmax", "aten::_softmax", "aten::log_softmax", "aten::_log_softmax"}


def family(name: str) -> str:
    """The kernel family (analyze/analyses/kernel_families.py names) of a CPU op, from its name."""
    if name in GEMM_OPS:
        return "gemm"
    if name in CONV_OPS:
        return "conv"
    if name in ATTENTION_OPS:
        return "attention"
    if name in NORM_OPS:
        return "normalization"
    if name in SOFTMAX_OPS:
        return "reduction"
    if name in UNARY_OPS or name in BINARY_OPS or name in COPY_OPS:
        return "elementwise"
    return "other"


@functools.lru_cache(maxsize=1 << 16)
def _parsed(text: str):
    """A shapes text's JSON, parsed once however many signatures share it (mtia_rank_0's 11,946 signatures hold
    1,101 dims, 203 types and 5,606 concrete-inputs texts: 6.9k parses instead of 35.8k). Read-only: the
    formulas never change what they are given."""
    return json.loads(text)


@functools.lru_cache(maxsize=1 << 16)  # ranks of one job share their op signatures: each is modeled once
def model(name: str, dims_json: str | None, types_json: str | None, concrete_json: str | None
          ) -> tuple[str | None, float | None, float | None]:
    """(dtype, FLOPs, bytes) of one op; None where unknown. Any malformed argument list gives Nones."""
    try:
        dims = _parsed(dims_json) if dims_json else None
        types = _parsed(types_json) if types_json else []
        concrete = _parsed(concrete_json) if concrete_json else []
    except (ValueError, RecursionError):
        return None, None, None
    if not isinstance(dims, list) or not isinstance(types, list) or not isinstance(concrete, list):
        return None, None, None
    first_type = next((t for t in types if isinstance(t, str) and t in ELEMENT_BYTES), None)
    dtype = DTYPE_NAMES.get(first_type, first_type)
    try:
        flops, nbytes = _model(name, dims, types, concrete)
    except (TypeError, ValueError, IndexError, KeyError, ZeroDivisionError, OverflowError):  # hostile or odd shapes
        return dtype, None, None
    return dtype, flops, nbytes


def _model(name, dims, types, concrete) -> tuple[float | None, float | None]:
    if name in GEMM_OPS:
        return _gemm(name, dims, types)
    if name in CONV_OPS:
        return _conv(name, dims, types, concrete)
    if name in ATTENTION_OPS:
        return _attention(name, dims, types, concrete)
    if name in NORM_OPS or name in SOFTMAX_OPS:
        return None, _bytes_bound(name, dims, types)
    if name in UNARY_OPS or name in BINARY_OPS or name in COPY_OPS:
        return _elementwise(name, dims, types)
    return None, None


def _shape(dims: list, i: int) -> list[int]:
    shape = dims[i]
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ValueError("not a tensor shape")
    return shape


def _esize(types: list, i: int) -> int:
    return ELEMENT_BYTES[types[i]]  # KeyError (-> unknown) for a type without a known size


def _gemm(name: str, dims: list, types: list) -> tuple[float, float]:
    """2·M·N·K per matrix product (+ M·N for the added term), bytes of A, B, the added term and C."""
    if name in ("aten::mm", "aten::bmm"):
        a, b, e = _shape(dims, 0), _shape(dims, 1), _esize(types, 0)
        if name == "aten::mm" and (len(a), len(b)) == (2, 2) and a[1] == b[0]:
            (m, k), n, batch = a, b[1], 1
        elif name == "aten::bmm" and (len(a), len(b)) == (3, 3) and a[2] == b[1] and a[0] == b[0]:
            batch, m, k, n = a[0], a[1], a[2], b[2]
        else:
            raise ValueError("shapes do not multiply")
        return 2.0 * batch * m * n * k, float(batch * (m * k + k * n + m * n) * e)
    if name in ("aten::addmm", "aten::baddbmm"):
        c, a, b, e = _shape(dims, 0), _shape(dims, 1), _shape(dims, 2), _esize(types, 1)
        if name == "aten::addmm" and (len(a), len(b)) == (2, 2) and a[1] == b[0]:
            (m, k), n, batch = a, b[1], 1
        elif name == "aten::baddbmm" and (len(a), len(b)) == (3, 3) and a[2] == b[1] and a[0] == b[0]:
            batch, m, k, n = a[0], a[1], a[2], b[2]
        else:
            raise ValueError("shapes do not multiply")
        added = math.prod(c) * _esize(types, 0)
        return 2.0 * batch * m * n * k + batch * m * n, float(batch * (m * k + k * n + m * n) * e + added)
    if name == "aten::linear":  # y = x·Wᵀ + b, x [..., K], W [N, K]
        x, w, e = _shape(dims, 0), _shape(dims, 1), _esize(types, 0)
        if len(x) < 1 or len(w) != 2 or x[-1] != w[1]:
            raise ValueError("shapes do not multiply")
        m, k, n = math.prod(x[:-1]), x[-1], w[0]
        bias = len(dims) > 2 and isinstance(dims[2], list) and len(dims[2]) > 0
        return 2.0 * m * n * k + (m * n if bias else 0), float((m * k + n * k + m * n + (n if bias else 0)) * e)
    return _matmul(dims, types)


def _matmul(dims: list, types: list) -> tuple[float, float]:
    """torch.matmul's broadcasting (PyTorch docs, torch.matmul): 1-D operands become a row / column."""
    a, b, e = _shape(dims, 0), _shape(dims, 1), _esize(types, 0)
    if not a or not b:
        raise ValueError("0-d operand")
    a2, b2 = ([1] + a if len(a) == 1 else a), (b + [1] if len(b) == 1 else b)
    if a2[-1] != b2[-2]:
        raise ValueError("shapes do not multiply")
    batch_a, batch_b = a2[:-2], b2[:-2]
    width = max(len(batch_a), len(batch_b))
    batch_a, batch_b = [1] * (width - len(batch_a)) + batch_a, [1] * (width - len(batch_b)) + batch_b
    if any(x != y and 1 not in (x, y) for x, y in zip(batch_a, batch_b)):
        raise ValueError("batch dimensions do not broadcast")
    batch = math.prod(max(x, y) for x, y in zip(batch_a, batch_b))
    m, k, n = a2[-2], a2[-1], b2[-1]
    return 2.0 * batch * m * n * k, float((math.prod(a) + math.prod(b) + batch * m * n) * e)


def _int_tuple(text: str, ndims: int, default: int) -> list[int]:
    """'[2, 2]' or '[2]' (broadcast to every spatial dim) or '' (the default) from Concrete Inputs."""
    if text in ("", None):
        return [default] * ndims
    values = [int(v) for v in re.findall(r"-?\d+", text)]
    if len(values) == 1:
        return values * ndims
    if len(values) != ndims:
        raise ValueError("argument length")
    return values


def _conv(name: str, dims: list, types: list, concrete: list) -> tuple[float, float]:
    """Convolution FLOPs from input, weight, stride, padding, dilation, groups (see module docstring)."""
    if name == "aten::convolution_backward":
        # grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, output_mask
        grad_out, x, w = _shape(dims, 0), _shape(dims, 1), _shape(dims, 2)
        transposed = concrete[7] == "True"
        mask = [m == "true" or m == "True" for m in re.findall(r"[A-Za-z]+", concrete[10])]
        if len(mask) != 3 or len(x) < 3:
            raise ValueError("output_mask")
        per_grad = 2.0 * math.prod(x if transposed else grad_out) * math.prod(w[1:])
        flops = per_grad * (mask[0] + mask[1]) + (math.prod(grad_out) if mask[2] else 0)
        e = _esize(types, 1)
        nbytes = (math.prod(grad_out) + math.prod(x) + math.prod(w)) * e + (math.prod(x) * e if mask[0] else 0) \
            + (math.prod(w) * e if mask[1] else 0)
        return flops, float(nbytes)
    x, w, e = _shape(dims, 0), _shape(dims, 1), _esize(types, 0)
    ndims = len(x) - 2
    if ndims < 1 or len(w) != len(x):
        raise ValueError("not a convolution")
    bias = len(dims) > 2 and isinstance(dims[2], list) and len(dims[2]) > 0
    if name in ("aten::convolution", "aten::_convolution"):  # input, weight, bias, stride, padding, dilation, transposed, output_padding, groups
        transposed = concrete[6] == "True"
        stride, padding, dilation = (_int_tuple(concrete[i], ndims, d) for i, d in ((3, 1), (4, 0), (5, 1)))
        output_padding = _int_tuple(concrete[7], ndims, 0)
    else:  # conv1d/2d/3d: input, weight, bias, stride, padding, dilation, groups ('same'/'valid' padding: unknown)
        transposed = False
        stride, padding, dilation = (_int_tuple(concrete[i], ndims, d) for i, d in ((3, 1), (4, 0), (5, 1)))
        output_padding = [0] * ndims
    if transposed:
        spatial = [(i - 1) * s - 2 * p + d * (k - 1) + op + 1
                   for i, k, s, p, d, op in zip(x[2:], w[2:], stride, padding, dilation, output_padding)]
        out = [x[0], w[1] * int(concrete[8])] + spatial  # weight [C_in, C_out / groups, k...]
        flops = 2.0 * math.prod(x) * math.prod(w[1:])
    else:
        spatial = [(i + 2 * p - d * (k - 1) - 1) // s + 1 for i, k, s, p, d in zip(x[2:], w[2:], stride, padding, dilation)]
        out = [x[0], w[0]] + spatial
        flops = 2.0 * math.prod(out) * math.prod(w[1:])
    if any(s <= 0 for s in spatial):
        raise ValueError("empty output")
    flops += math.prod(out) if bias else 0
    nbytes = (math.prod(x) + math.prod(w) + (out[1] if bias else 0) + math.prod(out)) * e
    return flops, float(nbytes)


def _attention(name: str, dims: list, types: list, concrete: list) -> tuple[float | None, float]:
    layout, causal_at, backward = ATTENTION_OPS[name]
    first = 1 if backward else 0  # backward ops take grad_out first
    q, k, v = (_shape(dims, first + i) for i in range(3))
    if not len(q) == len(k) == len(v) == 4:
        raise ValueError("not 4-d q/k/v")
    b, hq, nq, d_qk = (q[0], q[1], q[2], q[3]) if layout == "BHND" else (q[0], q[2], q[1], q[3])
    hkv, nkv, d_v = (k[1], k[2], v[3]) if layout == "BHND" else (k[2], k[1], v[3])
    if k[-1] != d_qk or b != k[0] or b != v[0]:
        raise ValueError("q/k/v do not match")
    causal_text = concrete[causal_at] if causal_at < len(concrete) else ""
    if causal_text not in ("True", "False", "true", "false"):
        return None, None  # is_causal not recorded: the FLOPs depend on it
    causal = causal_text.lower() == "true"
    e = _esize(types, first)
    if backward:
        flops = 2.0 * b * hq * nq * nkv * (3 * d_qk + 2 * d_v)
        nbytes = 2 * (b * nq * hq * d_qk + b * nkv * hkv * (d_qk + d_v)) + b * nq * hq * d_v
    else:
        flops = 2.0 * b * hq * nq * nkv * (d_qk + d_v)
        nbytes = b * nq * hq * (d_qk + d_v) + b * nkv * hkv * (d_qk + d_v)
    if causal:
        if nq != nkv:
            return None, float(nbytes * e)  # the masked share is not one half then
        flops /= 2
    return flops, float(nbytes * e)


def _tensor_bytes(dims: list, types: list) -> list[tuple[int, int]]:
    """(elements, bytes per element) of each tensor input (scalars and absent optionals left out)."""
    out = []
    for i, shape in enumerate(dims):
        if i < len(types) and types[i] in ELEMENT_BYTES and isinstance(shape, list) and shape != [] \
                and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            out.append((math.prod(shape), ELEMENT_BYTES[types[i]]))
    return out


def _elementwise(name: str, dims: list, types: list) -> tuple[float, float]:
    tensors = _tensor_bytes(dims, types)
    if not tensors:
        raise ValueError("no tensor input")
    shapes = [_shape(dims, i) for i, s in enumerate(dims) if i < len(types) and types[i] in ELEMENT_BYTES and s != []]
    width = max(len(s) for s in shapes)
    padded = [[1] * (width - len(s)) + s for s in shapes]
    out_shape = [max(col) for col in zip(*padded)]
    if any(d not in (1, out) for col, out in zip(zip(*padded), out_shape) for d in col):
        raise ValueError("does not broadcast")
    out_elems = math.prod(out_shape)
    if name in COPY_OPS and name == "aten::copy_":  # copy_(self, src): read src, write self
        return 0.0, float(tensors[-1][0] * tensors[-1][1] + tensors[0][0] * tensors[0][1])
    read = sum(n * e for n, e in tensors)
    written = out_elems * tensors[0][1]
    return (0.0 if name in COPY_OPS else float(out_elems)), float(read + written)


def _bytes_bound(name: str, dims: list, types: list) -> float:
    """Normalization and softmax: the input read, an output of the input's shape written, weights read."""
    x = _shape(dims, 0)
    e = _esize(types, 0)
    params = sum(n * size for n, size in _tensor_bytes(dims[1:], types[1:]))
    return float(2 * math.prod(x) * e + params)
