"""benchmarks/profiles.py's split of a profiled window by kind of work, on the names the profiler
really reports, and the commands that print it (``throughput.py --profile-steps``,
``targets.py --profile``)."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from profiles import KIND_ORDER, SCOPES, Breakdown, breakdown, covered, kind_of  # noqa: E402  (a benchmark script)


@pytest.mark.parametrize(("name", "kind"), [
    # CPU operators, and lowcomm's own
    ("aten::mm", "matmul"),
    ("aten::addmm", "matmul"),
    ("aten::baddbmm_", "matmul"),
    ("lowcomm::block_topk", "top-k/sort"),  # "lowcomm" holds "mm": the namespace is not the op
    ("lowcomm::dct_blocks_topk", "DCT kernels"),  # DeMo's encode: the transform, then its top-k
    ("lowcomm::dct_gathered_update", "DCT kernels"),  # DeMo's decode: not a gather
    ("aten::topk", "top-k/sort"),
    ("aten::index_add_", "scatter/gather"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", "attention"),
    ("c10d::allreduce_", "communication"),
    ("gloo:all_gather", "communication"),
    ("aten::copy_", "copy/cast"),
    ("aten::_to_copy", "copy/cast"),
    ("aten::cat", "copy/cast"),
    ("aten::sign_", "elementwise"),
    ("aten::masked_select", "scatter/gather"),
    ("aten::_log_softmax", "elementwise"),
    # GPU kernels, as the profiler names them: cuBLAS, cutlass, cuBLASLt's nvjet and its split-K reduction
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn", "matmul"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel"
     "__5x_cublas", "matmul"),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x1_tn_align8>"
     "(cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x1_tn_align8::Params)", "matmul"),
    ("nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_NTN", "matmul"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, true, false, "
     "false>(cublasLt::cublasSplitKParams<float>, float const*, __nv_bfloat16 const*, __nv_bfloat16*)", "matmul"),
    # attention: flash, memory-efficient (a cutlass kernel: attention first) and cuDNN's
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, "
     "cutlass::bfloat16_t, Flash_kernel_traits<64, 128, 128, 4, cutlass::bfloat16_t> >, false, true, false, "
     "false, true, true, false, false>(pytorch_flash::Flash_fwd_params)", "attention"),
    ("fmha_cutlassB_bf16_aligned_64x64_k64_sm80(PyTorchMemEffAttention::AttentionBackwardKernel<cutlass::arch::"
     "Sm80, cutlass::bfloat16_t, true, false, false, 64, 64, 64, false>::Params)", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0", "attention"),
    # communication, torch.compile's kernels, copies and fills, top-k, indexing
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("triton_poi_fused__to_copy_add_mul_0", "fused (compiled)"),  # a pointwise kernel: not a copy
    ("triton_red_fused__log_softmax_1", "fused (compiled)"),
    ("triton_per_fused_native_layer_norm_2", "fused (compiled)"),
    ("triton_tem_fused_mm_3", "matmul"),  # inductor's matmul template
    # inductor names a kernel after the operators it fused: its prefix says what it is
    ("triton_poi_fused_addmm_gelu_0", "fused (compiled)"),
    ("triton_red_fused_mm_1", "fused (compiled)"),
    ("triton_poi_fused__scaled_dot_product_flash_attention_0", "fused (compiled)"),
    ("triton_for_fused_0", "fused (compiled)"),  # a foreach kernel
    ("## Call CompiledFxGraph fgsnmg4ti2zolhsdnrlvfrwfzkvqm6yndxqfenomrxqqhb3wlyue ##", "fused (compiled)"),
    # collectives by any of their names
    ("record_param_comms", "communication"),
    ("_c10d_functional::wait_tensor", "communication"),
    ("_c10d_functional::all_gather_into_tensor", "communication"),
    ("Memcpy HtoD (Pageable -> Device)", "copy/cast"),
    ("Memset (Device)", "copy/cast"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, "
     "std::array<char*, 1ul> >(int, at::native::FillFunctor<float>, std::array<char*, 1ul>)", "copy/cast"),
    ("void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>(at::cuda::detail::TensorInfo<float, "
     "unsigned int>, unsigned int, unsigned int, bool, unsigned int, unsigned int, at::cuda::detail::TensorInfo"
     "<float, unsigned int>, unsigned int, at::cuda::detail::TensorInfo<long, unsigned int>, unsigned int, "
     "unsigned int*)", "top-k/sort"),
    ("void at::native::indexFuncLargeIndex<float, long, unsigned int, 2, 2, -2, true, at::native::"
     "ReduceAdd>(at::cuda::detail::TensorInfo<float, unsigned int>)", "scatter/gather"),
    # fused AdamW: "FusedAdamMathFunctor" holds "mm", which is a whole word only in a matmul's name
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
     "TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, "
     "(at::native::ADAM_MODE)1, false>, double*, double, double, double, double, double, bool, float*, "
     "float*>(at::native::(anonymous namespace)::TensorListMetadata<4>, at::native::(anonymous namespace)::"
     "FusedAdamMathFunctor<float, 4, (at::native::ADAM_MODE)1, false>, double*, double, double, double, double, "
     "double, bool, float*, float*)", "elementwise"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, "
     "std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul>)", "elementwise"),
])
def test_names_are_sorted_by_what_they_do(name, kind):
    assert kind_of(name) == kind


@pytest.mark.parametrize(("intervals", "length"), [
    ([], 0.0),
    ([(0, 2)], 2.0),
    ([(0, 2), (5, 6)], 3.0),  # apart
    ([(0, 4), (1, 2)], 4.0),  # inside another
    ([(3, 6), (0, 4), (10, 11)], 7.0),  # overlapping, unsorted
    ([(0, 1), (1, 2)], 2.0),  # touching
])
def test_covered_counts_overlaps_once(intervals, length):
    assert covered(intervals) == length


def _event(name, start_us, end_us, device="CUDA", annotation=False, self_us=None):
    return SimpleNamespace(name=name, device_type=getattr(DeviceType, device), is_user_annotation=annotation,
                           is_async=False, time_range=SimpleNamespace(start=start_us, end=end_us),
                           self_cpu_time_total=end_us - start_us if self_us is None else self_us)


def test_a_gpu_window_is_its_kernels_by_kind_and_the_idle_is_what_they_leave():
    """A step in 5 ms of wall time: a matmul 0-1 ms, an NCCL all-reduce 0.5-1.5 ms beside it
    (another stream), attention 2-2.25 ms, a Triton kernel 3-3.5 ms; a user range 0-4 ms on the
    GPU and CPU operators are not the device's work. Busy: the union 0-1.5, 2-2.25, 3-3.5 = 2.25 ms;
    idle 2.75 ms."""
    events = [
        _event("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn", 0, 1000),
        _event("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 500, 1500),
        _event("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64> >(Flash_fwd_params)", 2000, 2250),
        _event("triton_poi_fused_add_mul_0", 3000, 3500),
        _event("DeMo.topk", 0, 4000, annotation=True),
        _event("aten::mm", 0, 900, device="CPU"),
        _event("cudaLaunchKernel", 0, 20, device="CPU"),
    ]
    window = breakdown(events, "cuda", steps=1, wall_s=5e-3)
    assert window.busy_s == pytest.approx(2.25e-3)
    assert window.uncovered_s == pytest.approx(2.75e-3)
    assert window.kinds["matmul"] == pytest.approx(1e-3)
    assert window.kinds["communication"] == pytest.approx(1e-3)
    assert window.kinds["attention"] == pytest.approx(0.25e-3)
    assert window.kinds["fused (compiled)"] == pytest.approx(0.5e-3)
    assert set(window.kinds) == set(KIND_ORDER)
    assert sum(window.kinds.values()) == pytest.approx(window.busy_s + 0.5e-3)  # NCCL's overlap, counted in both
    assert "DeMo.topk" not in dict(window.top)
    shares = window.shares()
    assert shares["device idle (waiting for the host)"] == pytest.approx(0.55)
    # 1e12 FLOPs in a 5 ms step at 1e15 FLOP/s: MFU 20 %; in its 1.25 ms of matmul and attention
    # alone the same FLOPs would be 80 % of peak
    table = window.table(flops_per_step=1e12, peak_flops=1e15)
    assert "MFU (6N) of the window 20.0%" in table
    assert "would be 80.0% of peak" in table
    assert re.search(r"^\| device idle \(waiting for the host\) \| 2\.75 \| 55\.0% \|$", table, re.MULTILINE)
    assert re.search(r"^\| matmul \| 1\.00 \| 20\.0% \|$", table, re.MULTILINE)
    assert "| top-k/sort |" not in table  # a kind with no time is left out
    assert "kinds overlap by 0.50 ms/step" in table


def test_a_cpu_window_is_its_operators_own_time_and_the_rest_is_outside_them():
    """A range's own time and the autograd engine's scopes are not operators; inductor's range,
    around its generated C++ kernels, is work."""
    events = [
        _event("aten::matmul", 0, 1000, device="CPU", self_us=100),
        _event("aten::mm", 50, 950, device="CPU", self_us=900),
        _event("DeMo.topk", 0, 3000, device="CPU", annotation=True, self_us=1000),
        _event("aten::topk", 1000, 3000, device="CPU"),
        _event("autograd::engine::evaluate_function: MmBackward0", 3000, 3200, device="CPU", self_us=50),
        _event("MmBackward0", 3000, 3200, device="CPU", self_us=150),
        _event("## Call CompiledFxGraph abc ##", 3200, 3700, device="CPU", annotation=True, self_us=500),
    ]
    window = breakdown(events, "cpu", steps=1, wall_s=5e-3)
    assert window.kinds["matmul"] == pytest.approx(1e-3)
    assert window.kinds["top-k/sort"] == pytest.approx(2e-3)
    assert window.kinds["fused (compiled)"] == pytest.approx(0.5e-3)
    assert window.busy_s == pytest.approx(3.5e-3)
    assert window.uncovered_s == pytest.approx(1.5e-3)  # the ranges' and scopes' own time, and what nothing covers
    assert window.shares()["outside operators (Python, autograd, waits)"] == pytest.approx(0.3)


def test_a_real_cpu_profile_splits_its_operator_time_without_losing_or_counting_twice():
    """Conservation on a real profile: the kinds' self times sum to the top-level operators' whole
    times (each nested operator counted once), and no range is counted as work."""
    from torch.profiler import ProfilerActivity, profile, record_function

    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    inputs = torch.randn(32, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("DeMo.topk"):
            out = model(inputs)
            out.abs().topk(5, dim=-1)
            out.sum().backward()
    events = prof.events()
    window = breakdown(events, "cpu", steps=1, wall_s=10.0)
    def counted(event):  # an operator: not a range, not one of the autograd engine's scopes
        return (event.device_type == DeviceType.CPU and not event.is_user_annotation and not event.is_async
                and not SCOPES.fullmatch(event.name))

    def top_level(event):  # no operator above it
        parent = event.cpu_parent
        while parent is not None and not counted(parent):
            parent = parent.cpu_parent
        return parent is None

    top = [event for event in events if counted(event) and top_level(event)]
    assert any(event.name.endswith("Backward0") for event in events)  # the backward's scopes were there
    assert window.busy_s == pytest.approx(sum(event.cpu_time_total for event in top) / 1e6, rel=1e-6)
    assert window.kinds["matmul"] > 0 and window.kinds["top-k/sort"] > 0
    assert "DeMo.topk" not in dict(window.top)


@pytest.mark.slow
def test_a_compiled_region_on_the_cpu_is_fused_work_and_its_wrappers_are_not():
    """torch.compile on the CPU: inductor's C++ kernels run inside its ``## Call CompiledFxGraph``
    scope, whose own time is the fused work; dynamo's guards and wrappers around it are not."""
    from torch.profiler import ProfilerActivity, profile

    compiled = torch.compile(lambda x: (x.sin() * 2 + 1).relu().sum())
    inputs = torch.randn(512, 512)
    compiled(inputs)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            compiled(inputs)
    events = prof.events()
    window = breakdown(events, "cpu", steps=3, wall_s=10.0)
    fused = [e for e in events if e.name.startswith("## Call CompiledFxGraph")]
    assert len(fused) == 3
    assert window.kinds["fused (compiled)"] == pytest.approx(sum(e.self_cpu_time_total for e in fused) / 1e6)
    assert window.kinds["fused (compiled)"] > 0.5 * window.busy_s
    wrappers = {e.name for e in events if SCOPES.fullmatch(e.name)}
    assert "TorchDynamo Cache Lookup" in wrappers and not wrappers & {name for name, _ in window.top}


def test_a_breakdown_survives_the_trip_from_a_worker_as_a_dict():
    window = Breakdown("cpu", 3, 1.0, dict.fromkeys(KIND_ORDER, 0.1), 0.9, [("aten::mm", 0.1)])
    assert Breakdown(**vars(window)) == window


@pytest.mark.slow
def test_throughput_prints_where_its_profiled_steps_go(capfd):
    """End to end: lowcomm's warm steps profiled after the timing; the printed rows are the whole
    window (the kinds and the time outside operators sum to the wall time per step)."""
    from throughput import main

    assert main(["--workers", "1", "--steps", "4", "--repeats", "1", "--profile-steps", "2"]) == 0
    out = capfd.readouterr().out
    head = re.search(r"where the time of 2 profiled steps goes \(cpu\): ([\d.]+) ms/step wall, ([\d.]+) ms/step "
                     r"in operators", out)
    assert head, out
    rows = dict(re.findall(r"^\| ([^|]+?) \| ([\d.]+) \| [\d.]+% \|$", out, re.MULTILINE))
    assert "matmul" in rows and "outside operators (Python, autograd, waits)" in rows
    assert sum(float(ms) for ms in rows.values()) == pytest.approx(float(head.group(1)), abs=0.005 * (len(rows) + 1))
    assert "heaviest: " in out


def test_targets_refuses_a_profile_on_the_cpu(capsys):
    from targets import main

    with pytest.raises(SystemExit) as exit_:
        main(["--profile", "3"])
    assert exit_.value.code == 2
    assert "--profile profiles the training rows, which run on a GPU: use it with --device cuda" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_real_gpu_profile_is_its_kernels_and_no_range_is_counted():
    from torch.profiler import ProfilerActivity, profile, record_function

    device = torch.device("cuda", 0)
    x = torch.randn(2048, 2048, device=device)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("DeMo.topk"):
            y = x @ x
            y.topk(8, dim=-1)
            torch.cuda.synchronize()
    window = breakdown(prof.events(), "cuda", steps=1, wall_s=1.0)
    assert window.kinds["matmul"] > 0 and window.kinds["top-k/sort"] > 0
    assert sum(window.kinds.values()) == pytest.approx(window.busy_s, rel=1e-6)  # one stream: nothing overlaps
    assert all(not name.startswith("DeMo.") for name, _ in window.top)
