"""Reference accelerator and filesystem figures used by estimates (GPU-hours, MFU, checkpoint
writes), in one place.

A foundation module (no torch) so that command-line help can quote them without loading the
library.
"""

# H100 SXM dense bf16 tensor-core peak (FLOP/s).
H100_BF16_PEAK_FLOPS = 989e12
# Dense bf16 tensor-core peaks by the name torch.cuda.get_device_name gives (a substring of it),
# NVIDIA's data sheets: the H200 has the H100's compute (more, faster memory), the A100 312 TFLOP/s.
BF16_PEAK_FLOPS = {"H100": H100_BF16_PEAK_FLOPS, "H200": H100_BF16_PEAK_FLOPS, "A100": 312e12}
# Model FLOP utilisation typical of well-tuned data-parallel transformer training.
TYPICAL_MFU = 0.4
# GPUs per node in the DeMo paper's runs (8 nodes x 8 GPUs): the default node size of the
# byte tables for strategies that group ranks by node.
PAPER_GPUS_PER_NODE = 8
# What one rank writes per second when it saves its share of a checkpoint (torch.save into a
# file hashed as it is written, then fsync; every rank writes its own files at the same time), in
# MB/s (1e6 bytes). Measured with benchmarks/checkpoint_write.py on the development machine
# (2026-11-25, a virtual disk, 1,000 MB per rank, best of 3): 475 MB/s with one rank writing,
# 433 MB/s per rank with two at once; rounded down. A parallel filesystem's client usually
# writes faster, but its total over a job's ranks is shared: measure yours on a compute node in
# the run root and set cluster.rank_write_MBps (its total / the ranks, where the total binds).
RANK_WRITE_MBPS = 400.0


def bf16_peak_flops(device_name: str) -> float | None:
    """The dense bf16 peak FLOP/s of the GPU named ``device_name`` (torch's name for it, e.g.
    "NVIDIA H100 80GB HBM3"); None for a device not in :data:`BF16_PEAK_FLOPS`."""
    return next((peak for model, peak in BF16_PEAK_FLOPS.items() if model in device_name), None)
