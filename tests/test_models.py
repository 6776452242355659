"""OLMo models from the config tree: the paper's exact sizes, and a tiny one that learns."""

from __future__ import annotations

import pytest
import torch

from lowcomm.config.compose import compose
from lowcomm.models import (
    FlopsPerToken,
    ModelSpec,
    build_model,
    count_parameters,
    flops_per_token,
    load_tokenizer,
)
from lowcomm.train.loop import next_token_loss


@pytest.mark.parametrize("name, expected", [("olmo_300m", 319_946_752), ("olmo_1b", 1_176_764_416)])
def test_paper_models_have_the_papers_parameter_counts_on_meta(name, expected):
    spec = ModelSpec(**compose([f"model={name}"]).model)
    model = build_model(spec, "meta")
    assert count_parameters(model) == expected
    assert all(p.device.type == "meta" for p in model.parameters())
    # no 1-D parameters: no biases, non-affine layer norms, tied embeddings
    assert all(p.dim() == 2 for p in model.parameters())


def test_tiny_model_trains_on_cpu():
    spec = ModelSpec(**compose(["model=tiny"]).model)
    model = build_model(spec, "cpu", seed=0)
    tokens = torch.tensor([load_tokenizer("bytes").encode("the cat sat on the mat. " * 3)[:64]] * 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss = next_token_loss(model, tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_same_seed_builds_identical_models():
    a, b = build_model(ModelSpec(), "cpu", seed=3), build_model(ModelSpec(), "cpu", seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def test_tokenizers_byte_level_round_trips_and_olmo_tokenizer_loads_offline():
    byte_tok = load_tokenizer("bytes")
    assert byte_tok.decode(byte_tok.encode("héllo ∑")) == "héllo ∑"
    olmo_tok = load_tokenizer("allenai_gpt-neox-olmo-dolma-v1_5")
    assert olmo_tok.eos_token_id == 50279
    assert olmo_tok.decode(olmo_tok.encode("Hello world")) == "Hello world"
    with pytest.raises(ValueError, match="unknown tokenizer 'nope'"):
        load_tokenizer("nope")


def test_flops_per_token_by_both_conventions_hand_derived():
    """The tiny model (d 64, 4 heads of 16, 2 layers, 155,648 parameters, tied) at 128 tokens:
    6N = 933,888; OLMo-core's adds 12 x 2 layers x 4 heads x 16 x 128 = 196,608 for attention and,
    tied, keeps the one matrix as the head. OLMo-1B untied would drop its 50,304 x 2,048 lookup."""
    tiny = ModelSpec()
    assert flops_per_token(tiny, 155_648, 128) == FlopsPerToken(933_888, 933_888 + 196_608)
    untied = ModelSpec(d_model=2048, n_heads=16, n_layers=16, embedding_size=50_304, weight_tying=False)
    per_token = flops_per_token(untied, 1_279_787_008, 2048)
    assert per_token.six_n == 6 * 1_279_787_008
    assert per_token.olmo_core == 6 * (1_279_787_008 - 50_304 * 2048) + 12 * 16 * 16 * 128 * 2048


def test_a_gpu_peak_is_found_by_its_torch_name():
    from lowcomm.hardware import bf16_peak_flops

    assert bf16_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert bf16_peak_flops("NVIDIA H200") == 989e12
    assert bf16_peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert bf16_peak_flops("Tesla T4") is None
