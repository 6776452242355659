"""The per-block top-k (lowcomm.compress.block_topk) against torch.topk of every block
gathered, and against hand-placed values: on both of its CPU paths, the C++ kernel
(lowcomm.compress.cpu_kernels) and the torch rounds, which must also agree with each other
entry for entry (and so must whole DeMo and SparseLoCo steps taken on each)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lowcomm.compress import block_topk as block_topk_module
from lowcomm.compress import cpu_kernels
from lowcomm.compress import dct_topk as dct_topk_module
from lowcomm.compress.block_topk import block_topk, group_rows, kernel_group_rows
from lowcomm.compress.dct import BlockLayout

PATHS = ["kernel", "torch"]


@pytest.fixture(params=PATHS)
def selection_path(request, monkeypatch):
    """Run the test on the C++ kernel (which must have been built: a machine where lowcomm's
    tests run has a compiler) and on the torch rounds."""
    if request.param == "kernel":
        assert cpu_kernels.available(), "lowcomm's CPU kernels did not build (see the warning)"
    else:
        monkeypatch.setattr(cpu_kernels, "ops", lambda: None)
    return request.param


def reference(matrix: torch.Tensor, layout: BlockLayout, k: int) -> torch.Tensor:
    """torch.topk of each gathered block: block-local indices, sorted per block."""
    blocks = layout.blocked(matrix.view(layout.rows, layout.cols)).abs().reshape(layout.num_blocks, -1)
    return torch.topk(blocks, k, dim=1).indices.sort(dim=1).values


@pytest.mark.parametrize(
    ("shape", "chunk", "k", "rows_per_group"),
    [
        ((3072, 1024), 64, 32, 8),  # OLMo-300M's att_proj, DeMo's settings
        ((1024, 4096), 64, 64, 8),  # ff_out, SparseLoCo's k
        ((256, 192), 32, 4, 8),
        ((96, 40), 16, 8, 4),  # 16 x 10 blocks: at g = 8, k g = 64 is above a quarter of 160
        ((100, 37), 64, 32, 5),  # 50 x 37 blocks: 5 is the largest divisor of 50 up to 8
        ((64, 64), 64, 300, 2),  # 4 k g <= 4096 only at g = 2
        ((64, 64), 64, 600, 1),  # k g above a quarter of the block at every g
        ((5000,), 64, 32, 1),  # one row high: a group would be one entry
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.usefixtures("selection_path")
def test_selects_what_torch_topk_selects(shape, chunk, k, rows_per_group, dtype):
    layout = BlockLayout.for_shape(shape, chunk)
    k = min(k, layout.block_numel)
    assert group_rows(layout, k) == rows_per_group
    matrix = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    index, positions, values = block_topk(matrix, layout, k)
    assert index.shape == positions.shape == values.shape == (layout.num_blocks, k)
    assert torch.equal(values, matrix.view(-1)[positions])
    assert bool((index[:, 1:] > index[:, :-1]).all()), "each block's entries in ascending index"
    if dtype == torch.float32:  # distinct magnitudes: the same entries
        assert torch.equal(index.sort(dim=1).values, reference(matrix, layout, k))
    else:  # bf16 rounds into ties: the same magnitudes
        blocks = layout.blocked(matrix.view(layout.rows, layout.cols)).abs().reshape(layout.num_blocks, -1)
        chosen = matrix.view(-1)[positions].abs().sort(dim=1).values
        assert torch.equal(chosen, torch.topk(blocks, k, dim=1).values.sort(dim=1).values)
    # positions are the indices placed in the matrix, and unique
    assert torch.equal(positions, layout.global_index(index))
    assert positions.unique().numel() == positions.numel()


@pytest.mark.usefixtures("selection_path")
def test_two_winners_in_one_group_are_both_kept():
    """An 8 x 8 block, k = 2: groups are whole columns (8 rows); the two largest magnitudes sit
    in column 3, so one candidate per group would lose one. Hand-placed values."""
    matrix = torch.zeros(8, 8)
    matrix[1, 3], matrix[6, 3], matrix[2, 5], matrix[0, 0] = 5.0, -4.0, 3.0, 2.5
    layout = BlockLayout.for_shape(matrix.shape, 8)
    assert group_rows(layout, 2) == 8
    index, positions, _ = block_topk(matrix, layout, 2)
    assert sorted(index.view(-1).tolist()) == [1 * 8 + 3, 6 * 8 + 3]
    assert sorted(positions.view(-1).tolist()) == [11, 51]


@pytest.mark.usefixtures("selection_path")
def test_ties_keep_the_magnitudes_of_the_true_top_k():
    """Equal magnitudes (a zero block, repeated values, +x and -x): the entries chosen may
    differ from torch.topk's, their magnitudes may not."""
    generator = torch.Generator().manual_seed(3)
    matrix = torch.randint(-3, 4, (128, 128), generator=generator).float()
    matrix[:64, :64] = 0  # one block of zeros
    layout = BlockLayout.for_shape(matrix.shape, 64)
    assert group_rows(layout, 32) == 8
    index, positions, _ = block_topk(matrix, layout, 32)
    chosen = matrix.view(-1)[positions].abs().sort(dim=1).values
    blocks = layout.blocked(matrix).abs().reshape(layout.num_blocks, -1)
    assert torch.equal(chosen, torch.topk(blocks, 32, dim=1).values.sort(dim=1).values)
    assert all(row.unique().numel() == 32 for row in index)


@pytest.mark.usefixtures("selection_path")
def test_nan_is_selected_as_torch_topk_selects_it():
    """A NaN counts as the largest magnitude, as in torch.topk (so a diverged run sends it)."""
    matrix = torch.randn(64, 64, generator=torch.Generator().manual_seed(4))
    matrix[10, 20] = float("nan")
    layout = BlockLayout.for_shape(matrix.shape, 64)
    index, _, values = block_topk(matrix, layout, 32)
    assert 10 * 64 + 20 in index.view(-1).tolist()
    assert values.isnan().sum() == 1


# ------------------------------------------------------------- the kernel against the rounds
def both_paths(monkeypatch, run):
    """``run()`` with the selection on the kernel, then on the torch rounds. Only the selection
    changes: the block DCT stays on its own kernel both times (it rounds otherwise than the matrix
    products), and DeMo's transform-and-select kernel gives way to the transform then the rounds."""
    assert cpu_kernels.available(), "lowcomm's CPU kernels did not build (see the warning)"
    on_kernel = run()
    with monkeypatch.context() as patch:
        for module in (block_topk_module, dct_topk_module):
            patch.setattr(module, "selection_kernels", lambda _matrix: None)
        on_torch = run()
    return on_kernel, on_torch


@pytest.mark.parametrize(
    ("shape", "chunk", "k", "dtype"),
    [
        ((3072, 1024), 64, 32, torch.float32),  # 16 rows per group
        ((1024, 4096), 64, 64, torch.float64),
        ((96, 40), 16, 8, torch.float16),
        ((100, 37), 64, 32, torch.float32),  # 50 x 37 blocks: 10 rows per group
        ((64, 64), 64, 4096, torch.float32),  # every entry
        ((5000,), 64, 32, torch.float32),  # one row high: a group is one entry
        ((7, 3), 64, 1, torch.float32),  # one block, k = 1
    ],
)
def test_the_kernel_returns_what_the_rounds_return(shape, chunk, k, dtype, monkeypatch):
    """Distinct magnitudes: the same entries, in the same order, bit for bit."""
    layout = BlockLayout.for_shape(shape, chunk)
    k = min(k, layout.block_numel)
    matrix = torch.randn(shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(dtype)
    on_kernel, on_torch = both_paths(monkeypatch, lambda: block_topk(matrix, layout, k))
    for mine, theirs in zip(on_kernel, on_torch, strict=True):
        assert torch.equal(mine, theirs)


def test_the_kernel_breaks_ties_towards_the_lower_index():
    """Its documented rule (the rounds leave the choice open): a block of equal magnitudes
    gives its first k entries, whatever their signs."""
    assert cpu_kernels.available()
    matrix = torch.ones(16, 16)
    matrix[::2] = -1
    layout = BlockLayout.for_shape(matrix.shape, 16)
    index, positions, values = block_topk(matrix, layout, 20)
    assert index.tolist() == [list(range(20))]
    assert torch.equal(values.view(-1), matrix.view(-1)[:20])


def test_the_kernel_ranks_nan_and_infinity_first():
    """A block of NaN and +-inf among finite values: NaN and infinities fill the k places
    (NaN counting as the largest, as in torch.topk), an all-NaN block its first k."""
    assert cpu_kernels.available()
    matrix = torch.randn(16, 32, generator=torch.Generator().manual_seed(6))
    matrix[3, 4], matrix[9, 1], matrix[12, 15] = float("nan"), float("inf"), -float("inf")
    matrix[:, 16:] = float("nan")
    layout = BlockLayout.for_shape(matrix.shape, 16)
    index, _, values = block_topk(matrix, layout, 3)
    assert index.tolist() == [[3 * 16 + 4, 9 * 16 + 1, 12 * 16 + 15], [0, 1, 2]]
    assert values[0, 0].isnan() and values[0, 1:].abs().isinf().all() and values[1].isnan().all()


def test_the_kernel_rejects_what_it_cannot_select():
    assert cpu_kernels.available()
    kernel = cpu_kernels.ops().block_topk
    with pytest.raises(RuntimeError, match="do not tile"):
        kernel(torch.zeros(10, 10), 4, 4, 2, 1)
    with pytest.raises(RuntimeError, match="needs at least k groups of 8 rows per block, there are 8"):
        kernel(torch.zeros(8, 8), 8, 8, 9, 8)
    with pytest.raises(RuntimeError, match="contiguous"):
        kernel(torch.zeros(8, 16).T, 8, 8, 2, 1)


def test_tied_blocks_keep_their_lowest_indices_on_the_kernel():
    """A block of zeros (an embedding row no batch touched) and a block of one repeated
    magnitude: every entry ties, so every entry is a candidate; the kernel keeps the k lowest
    indices. Beside them a block of distinct magnitudes selects as torch.topk does."""
    assert cpu_kernels.available()
    layout = BlockLayout((64, 192), 64, 192, 64, 64)
    matrix = torch.zeros(64, 192)
    matrix[:, 64:128] = -2.5
    matrix[:, 128:] = torch.randn(64, 64, generator=torch.Generator().manual_seed(4))
    for k in (32, 2048):
        index, positions, values = block_topk(matrix, layout, k)
        assert index[0].tolist() == list(range(k)) and index[1].tolist() == list(range(k))
        assert (values[0] == 0).all() and (values[1] == -2.5).all()
        assert torch.equal(index[2], reference(matrix, layout, k)[2])
        assert torch.equal(matrix.view(-1)[positions.view(-1)], values.view(-1))


@pytest.mark.parametrize("wire", ["paper", "sign"])
def test_demo_steps_on_the_kernel_equal_those_on_the_rounds(wire, monkeypatch):
    """Three DeMo steps of OLMo-like shapes (64 x 64 blocks, one bucket): parameters and
    momenta bit for bit. The sign wire sends each block's mean magnitude, a sum over its
    entries in payload order, which is why both paths order them alike."""
    from lowcomm.optim import DeMo, DeMoArgs

    def run():
        generator = torch.Generator().manual_seed(7)
        params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in [(256, 128), (128, 512)]]
        optimizer = DeMo(params, DeMoArgs.defaults(lr=0.01, wire=wire, bucket_numel=10**9))
        for _ in range(3):
            for param in params:
                param.grad = torch.randn(param.shape, generator=generator)
            optimizer.step()
        momenta = [state["momentum_dct"] for state in optimizer.state.values()]
        return [param.detach().clone() for param in params] + [m.clone() for m in momenta]

    on_kernel, on_torch = both_paths(monkeypatch, run)
    for mine, theirs in zip(on_kernel, on_torch, strict=True):
        assert torch.equal(mine, theirs)


def test_sparseloco_payloads_on_the_kernel_equal_those_on_the_rounds(monkeypatch):
    """SparseLoCo's chunked top-k with 2-bit codes: the code table is computed from the kept
    values, so their order matters; the payloads are byte for byte the same."""
    from lowcomm.compress.chunked_topk import ChunkedTopK

    codec = ChunkedTopK(chunk=64, topk=64, bits=2, wire="packed")
    tensor = torch.randn(256, 192, generator=torch.Generator().manual_seed(8))
    on_kernel, on_torch = both_paths(monkeypatch, lambda: codec.encode(tensor).tensors)
    assert on_kernel.keys() == on_torch.keys()
    for key in on_kernel:
        assert torch.equal(on_kernel[key], on_torch[key]), key


# ------------------------------------------------------------------ building the kernels
def _python(code: str, tmp_path, **env) -> subprocess.CompletedProcess:
    environment = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions"), **env}
    return subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_failed_build_says_why_once_and_the_torch_path_runs(tmp_path):
    """No usable compiler: one line on stderr with the end of the builder's output, all of it in
    build-error.log, then the same selection by the torch rounds."""
    code = """
import torch
from lowcomm.compress import cpu_kernels
from lowcomm.compress.block_topk import block_topk
from lowcomm.compress.dct import BlockLayout
layout = BlockLayout.for_shape((64, 64), 16)
index, _, _ = block_topk(torch.arange(4096.0).view(64, 64), layout, 2)
block_topk(torch.zeros(64, 64), layout, 2)
print(cpu_kernels.available(), index[0].tolist(), cpu_kernels.build_directory())
"""
    result = _python(code, tmp_path, CXX=str(tmp_path / "no-such-compiler"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("False [254, 255] ")  # block (0, 0)'s two largest: its last row's last two
    warnings = [line for line in result.stderr.splitlines() if "could not be built" in line]
    assert len(warnings) == 1
    log = Path(result.stdout.strip().rsplit(" ", 1)[1]) / "build-error.log"
    assert f"all of it in {log}" in warnings[0] and "the torch paths run instead" in warnings[0]
    assert "no-such-compiler" in warnings[0] and "no-such-compiler" in log.read_text()


@pytest.mark.slow
def test_the_switch_turns_the_kernels_off_and_is_checked(tmp_path):
    code = "from lowcomm.compress import cpu_kernels; print(cpu_kernels.available())"
    off = _python(code, tmp_path, LOWCOMM_CPU_KERNELS="0")
    assert off.stdout.strip() == "False" and not (tmp_path / "extensions").exists()
    bad = _python(code, tmp_path, LOWCOMM_CPU_KERNELS="maybe")
    assert bad.returncode != 0 and "LOWCOMM_CPU_KERNELS='maybe': set it to 1" in bad.stderr


@pytest.mark.slow
def test_a_lock_left_by_a_killed_build_is_removed_and_the_build_goes_on(tmp_path):
    """torch's builder waits for its lock file with no time limit; found while nobody holds
    lowcomm's flock (a killed process's is dropped by the system), it is a leftover, removed
    with a line that says so, however fresh."""
    code = """
from lowcomm.compress import cpu_kernels
lock = cpu_kernels.build_directory() / "lock"
lock.parent.mkdir(parents=True)
lock.touch()
print(cpu_kernels.available(), lock.exists())
"""
    result = _python(code, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "False"]
    assert "left by a build that did not finish" in result.stderr
    assert "building the CPU kernels" in result.stderr


@pytest.mark.slow
def test_workers_starting_together_build_once_and_all_load(tmp_path):
    """Three processes at once on an empty build directory: one builds (one "building" line),
    every one loads the kernel and selects with it."""
    code = """
import torch
from lowcomm.compress import cpu_kernels
from lowcomm.compress.dct import BlockLayout
from lowcomm.compress.block_topk import block_topk
print(cpu_kernels.available(), block_topk(torch.arange(64.0).view(8, 8), BlockLayout.for_shape((8, 8), 8), 1)[0].item())
"""
    environment = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions")}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=environment, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outputs = [proc.communicate(timeout=300) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0, 0], [err for _, err in outputs]
    assert [out.split() for out, _ in outputs] == [["True", "63"]] * 3
    assert sum(err.count("building the CPU kernels") for _, err in outputs) == 1


def test_the_build_directory_is_keyed_by_source_installation_flags_and_cpu(monkeypatch, tmp_path):
    here = cpu_kernels.build_directory()
    changes = [
        ("_cpu_identity", lambda: "another CPU"),
        ("_FLAGS", ["-O2"]),
        ("SOURCE", tmp_path / "edited.cpp"),
    ]
    (tmp_path / "edited.cpp").write_text(cpu_kernels.SOURCE.read_text() + "// edited\n")
    for name, value in changes:
        with monkeypatch.context() as patch:
            patch.setattr(cpu_kernels, name, value)
            assert cpu_kernels.build_directory() != here, name
            assert cpu_kernels.build_directory().parent == here.parent
    with monkeypatch.context() as patch:
        patch.setattr(torch, "__file__", str(tmp_path / "another-venv" / "torch" / "__init__.py"))
        assert cpu_kernels.build_directory() != here
    assert cpu_kernels.build_directory() == here


@pytest.mark.parametrize(("shape", "chunk", "k", "rows"), [
    ((3072, 1024), 64, 32, 16),  # 4 x 64 groups per block, 2k = 64
    ((64, 64), 64, 600, 2),  # 16 rows would leave 256 groups, below 2k; 8: 512 and 4: 1024, too
    ((100, 37), 64, 32, 10),  # 50 x 37 blocks: 10 divides 50, 5 x 37 groups
    ((5000,), 64, 32, 1),  # one row high
    ((64, 64), 64, 4096, 1),  # every entry
])
def test_the_kernels_groups_leave_at_least_2k_per_block(shape, chunk, k, rows):
    layout = BlockLayout.for_shape(shape, chunk)
    k = min(k, layout.block_numel)
    assert kernel_group_rows(layout, k) == rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_kernel_ranks_by_each_dtypes_own_magnitude(dtype, monkeypatch):
    """Magnitudes equal once rounded to float32 (1 and 1 + 1e-12, 1e300 and 1e301) are
    distinct in float64 and must rank as such; NaN above +inf above any finite value."""
    matrix = torch.zeros(8, 8, dtype=dtype)
    if dtype == torch.float64:
        matrix[0, 0], matrix[5, 5] = 1.0, 1.0 + 1e-12
        matrix[1, 1], matrix[6, 6] = 1e300, -1e301
    matrix[2, 2], matrix[7, 0], matrix[3, 7] = float("inf"), float("nan"), -float("inf")
    layout = BlockLayout.for_shape(matrix.shape, 8)
    k = 5 if dtype == torch.float64 else 3
    on_kernel, on_torch = both_paths(monkeypatch, lambda: block_topk(matrix, layout, 1)[0].item())
    assert on_kernel == on_torch == 7 * 8 + 0  # the NaN
    if dtype == torch.float64:
        chosen = block_topk(matrix, layout, k)[0].view(-1).tolist()
        assert chosen == sorted([7 * 8, 2 * 8 + 2, 3 * 8 + 7, 6 * 8 + 6, 1 * 8 + 1])
        chosen = block_topk(matrix, layout, 6)[0].view(-1).tolist()
        assert 5 * 8 + 5 in chosen and 0 not in chosen  # 1 + 1e-12 above 1


def test_the_kernel_reads_a_strided_view_as_the_rounds_do(monkeypatch):
    matrix = torch.randn(192, 256, generator=torch.Generator().manual_seed(9)).T
    layout = BlockLayout.for_shape(matrix.shape, 64)
    on_kernel, on_torch = both_paths(monkeypatch, lambda: block_topk(matrix, layout, 32))
    for mine, theirs in zip(on_kernel, on_torch, strict=True):
        assert torch.equal(mine, theirs)
