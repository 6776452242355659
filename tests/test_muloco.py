"""MuLoCo: a W=2 tiny run with 2-bit statistical quantisation and error feedback; the workers
agree after a synchronisation and the bytes sent at it are the quantised payloads."""

from __future__ import annotations

import math

import pytest
import torch

from lowcomm.compress.registry import build_codec
from lowcomm.config import ConfigError, validate
from lowcomm.config.compose import compose
from lowcomm.models import build_model
from lowcomm.train.metrics import read_metrics
from runs import tiny_run, train_in_workers


def test_error_feedback_without_a_codec_is_rejected_with_the_fix():
    with pytest.raises(ConfigError, match="compression=quantize"):
        validate(compose(["optimizer=muloco"]))
    validate(compose(["optimizer=muloco", "optimizer.error_feedback=null"]))


@pytest.mark.slow
def test_two_bit_muloco_workers_agree_after_a_sync_and_send_the_quantised_payloads(tmp_path):
    run = tiny_run(tmp_path, "optimizer=muloco", "optimizer.sync_every=2", "compression=quantize",
                   "compression.bits=2", "train.checkpoint_every=0", workers=2, max_steps=2)
    train_in_workers(run)
    checkpoint = run.run_dir / "checkpoints" / "step_000000002"  # the final step is always saved
    model_state = torch.load(checkpoint / "model.pt")
    ranks = [torch.load(checkpoint / f"optim_rank{rank}.pt") for rank in range(2)]
    shared = torch.load(checkpoint / "optim.pt")  # the same on every worker: written once
    assert sorted(shared) == ["global_params", "outer_momentum"]
    assert all("global_params" not in own and "outer_momentum" not in own for own in ranks)
    names = [name for name, _ in build_model(run.model, "meta").named_parameters()]

    for index, name in enumerate(names):
        # rank 0's parameters were reset to the global copy
        assert torch.equal(model_state[name], shared["global_params"][index]), name
        # The accumulators hold what the 2-bit codes dropped: per worker, so they differ.
        assert ranks[0]["error_feedback"][index].abs().sum() > 0, name
        assert not torch.equal(ranks[0]["error_feedback"][index], ranks[1]["error_feedback"][index]), name
    inner = ranks[0]["inner"]
    assert sorted(inner) == ["adamw", "muon"]
    assert len(inner["adamw"]["state"]) == 1  # the tied embedding
    assert len(inner["muon"]["state"]) == len(names) - 1

    # The quantized all-reduce: each tensor cut by rows into one chunk per worker, each chunk 2 bits
    # per element packed into bytes plus its own table of 2^2 float32 bin means.
    chunks = [chunk.shape for tensor in shared["global_params"] for chunk in torch.tensor_split(tensor, 2)
              if chunk.numel()]
    expected = sum(math.ceil(math.prod(shape) * 2 / 8) + 4 * 4 for shape in chunks)
    codec = build_codec(run.compression)
    assert expected == sum(codec.payload_nbytes(torch.Size(shape), torch.float32) for shape in chunks)
    records = read_metrics(run.run_dir / "metrics.jsonl")
    assert [r["comm/payload_bytes"] for r in records] == [0, expected]
