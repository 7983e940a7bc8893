"""Kernel families: what kind of work a GPU kernel does, from its base name.

A demangled kernel name carries its return type, namespaces, template arguments and parameter types;
any of those can contain words of another family (`quantize_with_block_size<..., flashinfer::...>`
is not attention, `finalizeKernelVecLoad<..., cutlass::bfloat16_t>` is not a GEMM). So patterns are
matched against the base name only: `void at::native::(anonymous namespace)::foo<...>(...)` -> `foo`.
Generic wrappers (`cutlass::Kernel<Op>`, `cutlass::device_kernel<Op>`) name their operator in the
first template argument; the base name is then that argument's.

`FAMILIES` is the table: (family, case-insensitive regex over the base name, examples from real
traces). The first family whose pattern matches wins. Users put their own (family, pattern) rows in
front with `analyze --kernel-categories FILE`. memcpy and memset come from the event kind, not the name.
"""

from __future__ import annotations

import functools
import re

# fmt: off
FAMILIES: list[tuple[str, str, tuple[str, ...]]] = [
    ("communication",
     r"^(nccl|rccl|msccl)|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|sendrecv|^multimem_|nvls|"
     r"^cross_device_reduce|^(notify_|cached_notify_?)?(dispatch|combine)(_ll)?$|^c10d",
     ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "ncclKernel_AllReduce_RING_LL_Sum_float(ncclWorkElem)",
      "multimem_all_reduce_kernel", "void dpsk::ep::internode::dispatch_ll<true, 3, 10, 7168>(...)",
      "vllm::cross_device_reduce_1stage<half, 8>")),
    ("attention",
     r"flash|fmha|attention|attn|sdpa|^mha|_mha|scaled_dot_product|prefillwith|decodewith|^mergestates|xformers|"
     r"^triton_tem_fused_.*flex",
     ("void pytorch_flash::flash_fwd_kernel<...>(...)", "attn_fwd", "void paged_attention_ll4mi_QKV_mfma16_kernel<...>(...)",
      "fmha_cutlassF_f16_aligned_64x64_rf_sm80")),
    ("normalization",
     r"norm|^bn_|moments|gammabeta|welford|^cuComputePartGradGammaBeta|^cuApplyLayerNorm|"
     r"^compute(internalgradients|backwardfusedparams|fusedparams)cudakernel",  # GroupNorm (at::native group_norm_kernel.cu)
     ("void at::native::batch_norm_backward_kernel<...>(...)", "void cudnn::bn_bw_1C11_kernel_new<...>(...)",
      "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float>(...)",
      "void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernel<float, float>(...)")),
    ("conv",
     r"conv[^e]|conv$|scudnn|fprop|dgrad|wgrad|winograd|implicit_gemm|^igemm_(fwd|bwd|wrw)|miopen|nchwtonhwc|nhwctonchw|"
     r"im2col|col2im|^batched_transpose|^fft|^compute\w*offsetskernel",  # cuDNN's cask conv helpers
     ("sm80_xmma_fprop_implicit_gemm_indexed_tf32f32_tf32f32_f32_nhwckrsc_nchw_tilesize128x128x16_stage4_warpsize2x2x1_g1_tensor16x8x8_alignc4_execute_kernel_cudnn",
      "cudnn_ampere_scudnn_128x64_relu_xregs_large_nn_v1", "void implicit_convolve_sgemm<float, float, 1024, 6, 7, 3, 3, 5, 1, false, true, true>(...)",
      "void cudnn::cnn::wgrad_alg0_engine<float, 128, 6, 7, 3, 3, 5, false, 512>(...)",
      "igemm_bwd_gtcx2_nhwc_bf16_bx0_ex1_bt64x128x32_wt32x32x8_ws1x1_wr2x1_ta1x8x1x1_1x4x1x64_tb1x8x1x2_1x4x1x64_mh_gkgs",
      "batched_transpose_32x32_half")),
    ("gemm",
     r"gemm|gemv|xmma|nvjet|wgmma|^bmm|_bmm|matmul|^Cijk_|tensile|hipblaslt|splitk|^triton_tem_fused_.*mm|_mm_|^mm_|"
     r"^cutlass.*(tensorop|wmma|simt)|^dot_",
     ("ampere_sgemm_128x64_nn", "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas",
      "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_bf16_256x128_64x3_tn_align2>(...)",
      "Cijk_Alik_Bljk_BBS_BH_Bias_HA_S_SAV_UserArgs_MT256x192x64_MI16x16x1_...", "void gemv2N_kernel<...>(...)",
      "void splitKreduce_kernel<float, float, float, float, true, false, false>(...)")),
    ("embedding",
     r"^(split_)?embedding|embedding_?bag|^tbe_|index_?select|^bounds_check_indices|jagged|^permute_.*(data|lengths|embs)",
     ("void split_embedding_codegen_forward_unweighted_kernel<...>(...)",
      "void split_embedding_backward_codegen_rowwise_adagrad_unweighted_kernel_cta_per_row_1<...>(...)",
      "void fbgemm_gpu::permute_2D_data_kernel<false, int, int, decltype(nullptr)>(...)")),
    ("optimizer",
     r"multi_tensor|adam|lamb|adagrad|^sgd|lion|adafactor|fused_optim|^apply_(adam|sgd)|optimizer",
     ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...>(...)",)),
    ("reduction",
     r"reduce|reduction|softmax|argmax|argmin|topk|sort|scan|cumsum|cumprod|^sum_|_sum|mean|^max_pool|^avg_pool|pool|"
     r"cross_entropy|nll_?loss|classnllcriterion|^triton_(red|per)_|^finalizekernel",  # finalizeKernel*: TensorRT-LLM MoE weighted expert sum
     ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<...> >(...)", "void cub::DeviceRadixSortSingleTileKernel<...>(...)",
      "void at::native::(anonymous namespace)::max_pool_forward_nchw<float, float>(...)", "triton_red_fused_add_mean_mul_pow_rsqrt_0")),
    ("elementwise",
     r"elementwise|vectorized|unrolled|copy|fill|^cat|cat_|concat|index|scatter|gather|transpose|permute|pad|where|clamp|"
     r"dropout|gelu|silu|relu|sigmoid|tanh|swiglu|rotary|rope|quant|convert|cast|^triton_poi_|masked|arange|repeat|"
     r"upsample|distribution|random|uniform|philox|scale|bias|act_and_mul|activation|tensorop|kv_?cache|^cvt_|^scal_kernel",
     ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<long>, std::array<char*, 1ul> >(...)",
      "void at::native::(anonymous namespace)::CatArrayBatchedCopy<...>(...)", "triton_poi_fused_add_cos_sin_0",
      "void at::native::(anonymous namespace)::distribution_elementwise_grid_stride_kernel<...>(...)",
      "SubTensorOpWithScalar1d", "void (anonymous namespace)::store_kvcache<2048l, 4, false, long>(...)")),
    # Inductor names say the kind (poi = pointwise, red/per = reduction, tem = template): those go to
    # the families above; a Triton kernel whose kind the name does not tell lands here.
    ("triton", r"^triton", ("triton_tem_fused_0",)),
]
# fmt: on

FAMILY_NAMES = tuple(f for f, _, _ in FAMILIES) + ("memcpy", "memset", "other")

# Wrappers whose operator is their first template argument.
_WRAPPERS = {"kernel", "kernel2", "device_kernel", "kernel_with_params"}
_ANONYMOUS = re.compile(r"\((anonymous namespace|anonymous)\)")
_OPEN, _CLOSE = "<({[", ">)}]"


@functools.lru_cache(maxsize=1 << 14)  # the ranks of a run share their kernel names: parse each once per process
def base_name(name: str) -> str:
    """The kernel's own name: no return type, namespaces, template arguments or parameters."""
    text = _ANONYMOUS.sub("anonymous", name.strip())
    if text.startswith("_Z"):
        return _mangled_base(text)
    head, first_template = _split_top_level(text)
    qualified = head.split(" ")[-1] if head else text
    base = qualified.split("::")[-1] or qualified
    if base.lower() in _WRAPPERS and first_template:
        return base_name(first_template)
    return base


def _mangled_base(text: str) -> str:
    """The last component of a mangled nested name (`_ZN5aiter24add_rmsnorm_quant_kernelI...` ->
    `add_rmsnorm_quant_kernel`); a wrapper's operator is not decoded, so the whole name is kept then."""
    pos, parts = 3 if text.startswith("_ZN") else 2, []
    if text.startswith("_ZNK"):
        pos = 4
    while pos < len(text) and text[pos].isdigit():
        digits = re.match(r"\d+", text[pos:]).group()
        start = pos + len(digits)
        parts.append(text[start:start + int(digits)])
        pos = start + int(digits)
    if not parts or parts[-1].lower() in _WRAPPERS:
        return text
    return parts[-1]


def _split_top_level(text: str) -> tuple[str, str]:
    """The text before the parameter list with template arguments removed, and the first template argument."""
    head, depth, first_arg, arg_start, closing = [], 0, "", -1, False
    for i, ch in enumerate(text):
        if ch in _OPEN:
            if depth == 0 and ch == "(":  # the parameter list (or a cast in a trailing qualifier)
                break
            if depth == 0 and ch == "<" and not first_arg:
                arg_start = i + 1
            depth += 1
        elif ch in _CLOSE and depth > 0:
            depth -= 1
            closing = depth == 0 and arg_start >= 0 and not first_arg
        elif ch == "," and depth == 1 and arg_start >= 0 and not first_arg:
            first_arg = text[arg_start:i]
        if closing:
            first_arg, closing = first_arg or text[arg_start:i], False
        if depth == 0 and ch not in _CLOSE:
            head.append(ch)
    return "".join(head).strip(), first_arg.strip()
