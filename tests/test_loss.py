"""The next-token loss the training loop takes of the model's logits: compiled where the model is
compiled (``train.compile``), and then the same value and gradient as the eager loss."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from lowcomm.train.loop import compiled_cross_entropy, cross_entropy, next_token_loss, with_speed_settings

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def _value_and_gradient(loss, logits: torch.Tensor, targets: torch.Tensor, reduction: str):
    leaf = logits.detach().clone().requires_grad_()
    value = loss(leaf, targets, reduction)
    value.backward()
    return value.detach(), leaf.grad


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.slow
def test_the_compiled_loss_is_the_eager_loss(dtype, reduction):
    """Value and gradient, for bf16 logits (autocast's) and float32 ones, for the training mean
    and validation's sum. Dynamo is reset and its graph count read, so that a silent fallback to
    eager (a graph break, an unsupported op) fails here rather than passing as equal."""
    torch._dynamo.reset()
    counters.clear()
    generator = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 11, 257, generator=generator)).to(dtype)
    targets = torch.randint(0, 257, (3, 11), generator=generator)
    eager = _value_and_gradient(cross_entropy, logits, targets, reduction)
    compiled = _value_and_gradient(compiled_cross_entropy(), logits, targets, reduction)
    assert counters["stats"]["unique_graphs"] >= 1, "the compiled loss ran eagerly"
    assert not counters["graph_break"], f"the compiled loss broke its graph: {dict(counters['graph_break'])}"
    assert compiled[0].dtype == eager[0].dtype == torch.float32  # the loss is float32 whatever the logits
    assert compiled[1].dtype == eager[1].dtype == dtype
    # float32: the same reductions in another order; bf16: the gradient is rounded to bf16 at the end
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-4}
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(compiled[1], eager[1], **tolerance)
    # and it is the loss by its definition: minus the mean (or sum) log-probability of each target
    log_probabilities = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1))
    by_hand = -(log_probabilities.mean() if reduction == "mean" else log_probabilities.sum())
    torch.testing.assert_close(eager[0], by_hand, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("compile_setting", "compiled"), [(True, True), ("auto", False), (False, False)])
def test_the_loss_is_compiled_where_the_model_is(compile_setting, compiled):
    """One place decides: ``with_speed_settings`` returns the compiled loss with the compiled model
    (``auto`` compiles neither on the CPU), and the eager function itself otherwise."""
    train = SimpleNamespace(param_dtype="fp32", compile=compile_setting, precision="auto")
    model, _, loss = with_speed_settings(torch.nn.Linear(2, 2), train, torch.device("cpu"))
    assert (loss is compiled_cross_entropy()) is compiled
    assert (loss is cross_entropy) is not compiled
    assert hasattr(model, "_compiled_call_impl") and (model._compiled_call_impl is not None) is compiled  # noqa: SLF001


def test_next_token_loss_predicts_each_token_from_those_before_it():
    """The logits at position t are scored against token t + 1: a model that outputs, at each
    position, a one-hot of the next token (cheating by looking ahead) has a loss near zero."""
    tokens = torch.tensor([[5, 1, 4, 2, 3]])

    class LooksAhead(torch.nn.Module):
        def forward(self, inputs):
            assert inputs.tolist() == [[5, 1, 4, 2]]
            logits = torch.full((1, 4, 6), -30.0)
            logits[0, torch.arange(4), tokens[0, 1:]] = 30.0
            return SimpleNamespace(logits=logits)

    assert float(next_token_loss(LooksAhead(), tokens)) < 1e-6
    assert float(next_token_loss(LooksAhead(), tokens, "sum", cross_entropy)) < 1e-5


@pytest.mark.slow
def test_the_loss_benchmark_prints_the_ratio_of_its_two_times(capfd):
    from loss_step import main

    assert main(["--batch", "4", "--positions", "64", "--vocabulary", "2048", "--repeats", "2"]) == 0
    out = capfd.readouterr().out
    rows = re.findall(r"^\| (float32|bf16) \| ([\d.,]+) ms \| ([\d.,]+) ms \| ([\d.]+)x \|", out, re.MULTILINE)
    assert [row[0] for row in rows] == ["float32", "bf16"]
    for _, eager, compiled, ratio in rows:
        eager_ms, compiled_ms = (float(x.replace(",", "")) for x in (eager, compiled))
        # Each printed figure is rounded to two decimals, so the ratio of the printed times may
        # differ from the printed ratio by as much as those roundings allow, and no more.
        low = (eager_ms - 0.005) / (compiled_ms + 0.005) - 0.005
        high = (eager_ms + 0.005) / (compiled_ms - 0.005) + 0.005
        assert low <= float(ratio) <= high
