"""Kernel families from the base name, on real kernel names: from ../shared/corpus (file named beside
each), and, for families the corpus lacks, from public sources cited by URL."""

import polars as pl
import pytest

from steplens.analyze.analyses import comms, kernels
from steplens.analyze.analyses.kernel_families import FAMILIES, FAMILY_NAMES, base_name


@pytest.mark.parametrize("name,base", [
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float>(int, float, float const*, "
     "float const*, float const*, float*, float*, float*)", "vectorized_layer_norm_kernel"),
    # a wrapper names its operator in the first template argument
    ("void cutlass::Kernel<cutlass_80_tensorop_s1688gemm_64x64_32x4_nn_align1>(cutlass_80_tensorop_s1688gemm_64x64_32x4_nn_align1::Params)",
     "cutlass_80_tensorop_s1688gemm_64x64_32x4_nn_align1"),
    # lambdas and nested templates in the arguments
    ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl<at::native::(anonymous namespace)::"
     "direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#2}::operator()() const::{lambda()#8}::operator()() "
     "const::{lambda(float)#1}> >(int, at::native::gpu_kernel_impl<...>)", "elementwise_kernel"),
    # recorded undemangled (TraceLens/inference_sglang_decode/sglang_Qwen3-8B_decode.json.gz)
    ("_ZN5aiter24add_rmsnorm_quant_kernelIDF16bDF16bLi256ELi16ELb1ELb0ELb1ELi1EEEvPT0_PT_PfS4_S4_S4_diiiiiiib",
     "add_rmsnorm_quant_kernel"),
    ("ampere_sgemm_128x64_nn", "ampere_sgemm_128x64_nn"),
    ("void (anonymous namespace)::softmax_warp_forward<float, float, float, 10, true>(float*, float const*, int, int, int)",
     "softmax_warp_forward"),
])
def test_base_name_strips_return_type_namespaces_templates_and_parameters(name, base):
    assert base_name(name) == base


# (family, real kernel name, where it was recorded)
CORPUS_NAMES = [
    ("gemm", "ampere_sgemm_128x64_nn", "HolisticTraceAnalysis/critical_path_alexnet"),
    ("gemm", "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas",
     "TraceLens/h100/Qwen_Qwen1.5-0.5B-Chat__1016005.json.gz"),
    ("gemm", "void cutlass::Kernel<cutlass_80_simt_sgemm_128x32_8x5_nn_align1>(cutlass_80_simt_sgemm_128x32_8x5_nn_align1::Params)",
     "HolisticTraceAnalysis/nccl_parser_config"),
    ("gemm", "Cijk_Alik_Bljk_SB_Bias_AS_SAV_UserArgs_MT64x16x32_MI16x16x1_SN_LDSB0_AFC1_AFEM1_AFEM1_ASEM1_CLR1_CADS0_EPS0_GRVWA2",
     "TraceLens/mi300 (prefix of the recorded name)"),
    ("gemm", "void gemmk1_kernel<int, float, 256, 5, false, false, false, false, cublasGemvTensorStridedBatched<float const>, "
             "cublasGemvTensorStridedBatched<float const>, cublasGemvTensorStridedBatched<float>, float, 0>(cublasGemmk1Params<float, "
             "cublasGemvTensorStridedBatched<float const>, cublasGemvTensorStridedBatched<float const>, cublasGemvTensorStridedBatched<float>, "
             "float, biasType<cublasGemvTensorStridedBatched<float>::value_type, float>::type>)", "param/dlrm_kineto"),
    ("conv", "sm80_xmma_fprop_implicit_gemm_tf32f32_tf32f32_f32_nhwckrsc_nhwc_tilesize64x128x32_stage5_warpsize2x2x1_g1_tensor16x8x8_"
             "execute_kernel_cudnn_infer", "HolisticTraceAnalysis/nccl_parser_config"),
    ("conv", "cudnn_ampere_scudnn_128x64_relu_xregs_large_nn_v1", "HolisticTraceAnalysis/critical_path_alexnet"),
    ("conv", "void cudnn::winograd_nonfused::winogradForwardData4x4<float, float>(cudnn::winograd_nonfused::WinogradDataParams<float, float>)",
     "HolisticTraceAnalysis/ns_resolution_trace"),
    ("conv", "igemm_wrw_gtcx3_nhwc_bf16_bx0_ex1_bt128x128x32_wt32x32x8_ws1x1_wr2x2_ta1x4x1x4_1x8x1x32_tb1x4x1x4_1x8x1x32_gkgs",
     "TraceLens/mi300_ddp_resnet18_no_pool"),
    ("conv", "void nchwToNhwcKernel<float, float, float, true, false, (cudnnKernelDataType_t)0>(int, int, int, int, float const*, "
             "float*, float, float)", "kineto/tb_plugin_samples_resnet50_num_workers_0"),
    ("attention", "attn_fwd", "TraceLens/mi300/Qwen_Qwen1.5-0.5B-Chat__1016005.json.gz"),
    ("communication", "ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)",
     "HolisticTraceAnalysis/nccl_parser_config"),
    ("communication", "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclWorkElem)", "HolisticTraceAnalysis/trace_diff"),
    ("normalization", "void cudnn::bn_bw_1C11_singleread<float, 512, true, 1, 2, 0>(cudnn::bn_bw_1C11_args<float>)",
     "HolisticTraceAnalysis/nccl_parser_config"),
    ("normalization", "MIOpenBatchNormFwdTrainSpatial", "TraceLens/perf_model_normalization"),
    ("normalization", "void at::native::(anonymous namespace)::RowwiseMomentsCUDAKernel<float>(long, float, float const*, float*, float*)",
     "TraceLens/perf_model_normalization"),
    ("normalization", "_ZN5aiter24add_rmsnorm_quant_kernelIDF16bDF16bLi64ELi8ELb0ELb0ELb1ELi1EEEvPT0_PT_PfS4_S4_S4_diiiiiiib",
     "TraceLens/inference_sglang_decode"),
    ("reduction", "void (anonymous namespace)::softmax_warp_backward<float, float, float, 10, true>(float*, float const*, float const*, "
                  "int, int, int)", "kineto/plugin_samples_resnet50_num_workers_0"),
    ("reduction", "void cub::DeviceScanInitKernel<cub::ScanTileState<int, true> >(cub::ScanTileState<int, true>, int)",
     "HolisticTraceAnalysis/trace_diff"),
    ("reduction", "triton_red_fused_add_mean_mul_pow_rsqrt_0", "TraceLens/torch_compile_triton"),
    ("elementwise", "triton_poi_fused_add_cos_sin_0", "TraceLens/torch_compile_triton"),
    ("elementwise", "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, at::detail::Array<char*, 1> >"
                    "(int, at::native::FillFunctor<float>, at::detail::Array<char*, 1>)", "HolisticTraceAnalysis/critical_path_alexnet"),
    ("elementwise", "SubTensorOpWithScalar1d", "TraceLens/mi300_ddp_resnet18_no_pool"),
    ("embedding", "void split_embedding_codegen_forward_unweighted_kernel<float, float, float, false, long, 1ul, 8ul>"
                  "(at::GenericPackedTensorAccessor<float, 1ul, at::RestrictPtrTraits, long>)", "param/dlrm_kineto (arguments cut)"),
    ("optimizer", "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::TensorListMetadata<2>, "
                  "at::native::(anonymous namespace)::BinaryOpListAlphaFunctor<float, 2, 2, 0>, std::plus<float>, float>"
                  "(at::native::(anonymous namespace)::TensorListMetadata<2>, ...)", "kineto/plugin_samples_resnet50 (arguments cut)"),
]

# Families the corpus has no kernel of, with the public source that shows the name.
PUBLIC_NAMES = [
    # PyTorch symmetric-memory (NVLS multimem) collectives:
    # https://github.com/pytorch/pytorch/blob/main/torch/csrc/distributed/c10d/symm_mem/CUDASymmetricMemoryOps.cu
    ("communication", "multimem_all_reduce_kernel", "allreduce"),
    ("communication", "multimem_all_gather_kernel", "allgather"),
    # DeepEP low-latency dispatch/combine in DeepSeek's published decode trace:
    # https://github.com/deepseek-ai/profile-data/issues/19 (decode.json of https://github.com/deepseek-ai/profile-data)
    ("communication", "void dpsk::ep::internode::dispatch_ll<true, 3, 10, 7168>(void*, float*, int*, long*, int*, int*, void*, int*, "
                      "void*, void const*, long const*, int*, int*, int*, int, int, int, int, int, int, bool)", "alltoall"),
    ("communication", "void dpsk::ep::internode::combine_ll<true, 3, 10, 7168>(void*, int*, void*)", "alltoall"),
    # vLLM / SGLang custom all-reduce: https://github.com/vllm-project/vllm/blob/main/csrc/custom_all_reduce.cuh
    ("communication", "void vllm::cross_device_reduce_1stage<__nv_bfloat16, 8>(vllm::RankData*, vllm::RankSignals, vllm::Signal*, "
                      "__nv_bfloat16*, int, int)", "allreduce"),
    # cuBLASLt nvjet GEMMs on H200/B200: https://github.com/pytorch/pytorch/issues/161134
    ("gemm", "nvjet_tst_16x64_64x16_4x1_v_bz_TNN", None),
    ("gemm", "nvjet_tst_64x8_64x16_4x1_v_bz_TNT", None),
    # TensorRT-LLM / FlashInfer MoE kernels in a B200 profile: https://github.com/SemiAnalysisAI/InferenceX/issues/863
    ("gemm", "bmm_E2m1_E2m1E2m1_Fp32", None),
    ("gemm", "bmm_Bfloat16_E2m1E2m1_Fp32", None),
    ("gemm", "DeviceGemmFp4GemmSm100", None),
    ("reduction", "finalizeKernelVecLoad", None),  # the weighted sum of expert outputs, not a GEMM
    ("elementwise", "cvt_fp16_to_fp4", None),
]


def _family(name: str) -> str:
    return kernels.families(pl.Series([name], dtype=pl.String))["category"][0]


@pytest.mark.parametrize("family,name,where", CORPUS_NAMES, ids=lambda v: v if len(str(v)) < 40 else None)
def test_corpus_kernel_names_fall_in_their_family(family, name, where):
    assert _family(name) == family, (name, base_name(name), where)


@pytest.mark.parametrize("family,name,op", PUBLIC_NAMES, ids=lambda v: v if v and len(str(v)) < 40 else None)
def test_public_kernel_names_fall_in_their_family(family, name, op):
    assert _family(name) == family, (name, base_name(name))
    if op:  # a communication kernel is a collective, its op read from the name
        device = pl.DataFrame({"rank": [0], "kind": ["kernel"], "name": [name], "collective": [None], "ts_ns": [0], "dur_ns": [10],
                               "device": [0], "stream": [1], "step": [None], "event_id": [0], "group_name": [None],
                               "group_size": [None], "seq": [None], "in_nelems": [None], "out_nelems": [None], "dtype": [None],
                               "source": ["t"], "launch_event_id": [None]},
                              schema_overrides={"collective": pl.String, "step": pl.Int64, "group_name": pl.String,
                                                "group_size": pl.Int64, "seq": pl.Int64, "in_nelems": pl.Int64,
                                                "out_nelems": pl.Int64, "dtype": pl.String, "launch_event_id": pl.Int64})
        calls = comms.collectives(device, world_size=8)
        assert calls.select("op", "bytes").rows() == [(op, None)]


@pytest.mark.parametrize("name,wrong", [
    # the examples: a word of another family in the template arguments only
    ("void quantize_with_block_size<(BlockScaleQuantizationType)1, __nv_bfloat16, 16, false>(int, int, int, int, __nv_bfloat16 const*, "
     "float const*, unsigned int*, unsigned int*, flashinfer::QuantizationSFLayout)", "attention"),
    ("void tensorrt_llm::kernels::cutlass_kernels::finalizeKernelVecLoad<cutlass::bfloat16_t, cutlass::bfloat16_t, float>"
     "(cutlass::bfloat16_t const*, cutlass::bfloat16_t*)", "gemm"),
])
def test_template_arguments_do_not_decide_the_family(name, wrong):
    assert _family(name) not in (wrong, "other")


def test_every_documented_example_is_in_its_family():
    for family, _, examples in FAMILIES:
        for example in examples:
            assert _family(example) == family, (family, example)
    assert set(FAMILY_NAMES) >= {"gemm", "conv", "attention", "communication", "normalization", "elementwise", "reduction",
                                 "optimizer", "memcpy", "memset", "triton", "other"}
