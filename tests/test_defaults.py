"""Every optimizer on its paper's settings by default, and the conventions shared by all of them:
no weight decay on the embedding (OLMo's default), global-norm clipping as a per-strategy
choice, bf16 gradients for the DDP baselines, MuLoCo's own hyperparameters, and a DeMo top-k
that must compress."""

from __future__ import annotations

import contextlib

import pytest
import torch
from omegaconf import OmegaConf

from lowcomm.comm import Communicator
from lowcomm.comm.spawn import spawn_workers
from lowcomm.config import ConfigError, config_dir, validate_optimizer
from lowcomm.config.compose import compose
from lowcomm.models import ModelSpec, build_model
from lowcomm.strategies import STRATEGIES
from lowcomm.strategies.learners import LocalSynchronizer

# What each strategy needs beyond its defaults to build on two CPU workers.
EXTRA = {
    "muloco": ["compression=quantize"],  # its error feedback needs a codec
    "flexdemo": ["optimizer.shard_group_size=1"],  # DeMo across the two workers; FSDP groups of one
}
LR, WEIGHT_DECAY = 1e-2, 0.1


def _raw(name: str, *overrides: str) -> dict:
    return OmegaConf.to_container(compose([f"optimizer={name}", *EXTRA.get(name, []), *overrides]), resolve=True)


def _zero_gradient_steps(rank: int, world: int, name: str):
    """For each setting of decay_embeddings: build the strategy for real, run a forward/backward
    whose gradient is exactly zero (so the optimizer's own update is zero and only weight decay
    moves a parameter), take one step; rank 0 returns the full state before and after."""
    del world
    results = {}
    for decay_embeddings in (False, True):
        raw = _raw(name, f"optimizer.lr={LR}", f"optimizer.weight_decay={WEIGHT_DECAY}",
                   f"optimizer.decay_embeddings={str(decay_embeddings).lower()}")
        strategy_cls, cfg = validate_optimizer(raw)
        strategy = strategy_cls(cfg, raw["compression"], Communicator())
        model = build_model(ModelSpec(**raw["model"]), "cpu", seed=0)
        with contextlib.ExitStack() as stack:
            if strategy.learners:  # a learner of a synchronizer of its own (one step: nothing is merged)
                sync = stack.enter_context(LocalSynchronizer(strategy_cls, cfg, model, learners=1))
                strategy.connect(sync.address, 0, tokens_per_step=32)
            model, optimizer = strategy.build(model)
            before = {k: v.clone() for k, v in strategy.model_state_dict(model).items()}
            tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(rank))
            (model(tokens).logits.sum() * 0).backward()
            optimizer.step()
            strategy.finish(optimizer)
        results[decay_embeddings] = {"before": before, "after": strategy.model_state_dict(model)}
    return results if rank == 0 else None


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_weight_decay_spares_the_embedding_unless_asked(name):
    factor = 1 - LR * WEIGHT_DECAY  # decoupled weight decay of one step: p <- p (1 - lr wd)
    results = spawn_workers(_zero_gradient_steps, 2, name)[0]
    for decay_embeddings, result in results.items():
        before, after = result["before"], result["after"]
        embedding = "transformer.wte.weight"
        if decay_embeddings:
            torch.testing.assert_close(after[embedding], before[embedding] * factor, rtol=1e-6, atol=0)
        else:
            assert torch.equal(after[embedding], before[embedding]), f"{name}: the embedding was decayed"
        hidden = [k for k in before if k != embedding and before[k].ndim == 2]
        assert hidden
        for key in hidden:  # every other matrix is decayed, by exactly one step's factor
            torch.testing.assert_close(after[key], before[key] * factor, rtol=1e-6, atol=0, msg=f"{name}: {key}")


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_each_strategy_states_its_clipping_and_embedding_decay_in_its_config(name):
    text = (config_dir() / "optimizer" / f"{name}.yaml").read_text()
    assert "clip_global_norm:" in text and "decay_embeddings:" in text
    _, cfg = validate_optimizer(_raw(name))
    # DES-LOC's equations clip per coordinate and nothing else; every other method clips the norm
    assert cfg.clip_global_norm is (name != "desloc")
    assert cfg.decay_embeddings is False


def _desloc_steps(rank: int, world: int, max_grad_norm: float, run_root: str, clip_global_norm: bool = False):
    """DES-LOC through the training loop's own train_step: the loop decides about clipping."""
    from lowcomm.config import validate
    from lowcomm.distenv import DistEnv
    from lowcomm.train.loop import Trainer

    del world
    run = validate(compose(["optimizer=desloc", "wandb.mode=disabled", "cluster.workers=2",
                            "train.global_batch_size=4", "train.micro_batch_size=2", "train.seq_len=32",
                            "data.train_tokens=16384", "data.val_tokens=4096", "train.warmup_steps=0",
                            f"train.max_grad_norm={max_grad_norm}",
                            f"optimizer.clip_global_norm={str(clip_global_norm).lower()}", f"run_root={run_root}/{rank}"]))
    env = DistEnv(rank=rank, world_size=2, local_rank=rank, local_world_size=2)
    trainer = Trainer(run, env)
    for step in range(2):
        trainer.train_step(step)
    return {k: v.clone() for k, v in trainer.model.state_dict().items()}


@pytest.mark.slow
def test_desloc_is_not_norm_clipped_by_the_loop_unless_asked(tmp_path):
    # a global-norm clip this tight would shrink every gradient to almost nothing
    unclipped = spawn_workers(_desloc_steps, 2, 0.0, str(tmp_path / "a"))[0]
    tight = spawn_workers(_desloc_steps, 2, 1e-9, str(tmp_path / "b"))[0]
    for key, value in unclipped.items():
        assert torch.equal(value, tight[key]), key
    # and the same loop with the choice turned on does clip (the test can fail)
    clipped = spawn_workers(_desloc_steps, 2, 1e-9, str(tmp_path / "c"), True)[0]
    assert any(not torch.equal(value, clipped[key]) for key, value in unclipped.items())


def test_ddp_baselines_send_bf16_gradients_by_default():
    model = build_model(ModelSpec(**_raw("adamw_ddp", "model=olmo_300m")["model"]), "meta")
    for name in ("adamw_ddp", "muon_ddp"):
        raw = _raw(name)
        strategy_cls, cfg = validate_optimizer(raw)
        assert cfg.wire_dtype == "bfloat16"
        payload = strategy_cls(cfg, raw["compression"], Communicator()).analytic_payload_bytes(model)
        assert payload == 319_946_752 * 2  # 639.9 MB: 2 bytes per parameter of OLMo-300M
    strategy_cls, cfg = validate_optimizer(_raw("adamw_ddp", "optimizer.wire_dtype=float32"))
    assert strategy_cls(cfg, {}, Communicator()).analytic_payload_bytes(model) == 319_946_752 * 4


def test_muloco_defaults_are_the_papers():
    _, cfg = validate_optimizer(_raw("muloco"))
    # Thérien et al. 2025: wd 7.2e-5, beta1 0.9 for Muon (Nesterov) and AdamW, AdamW beta2 0.99,
    # inner lr 0.0026827 (Optax's Muon scale sqrt(max(1, out/in)) = torch's "original"), H 30,
    # outer Nesterov SGD lr 0.8 / momentum 0.9, error-feedback beta 0.9
    assert cfg.weight_decay == pytest.approx(7.2e-5)
    assert (cfg.muon_momentum, cfg.muon_nesterov, list(cfg.betas)) == (0.9, True, [0.9, 0.99])
    assert (cfg.lr, cfg.adjust_lr_fn) == (0.0026827, "original")
    assert (cfg.sync_every, cfg.outer_lr, cfg.outer_momentum, cfg.nesterov, cfg.error_feedback) == (
        30, 0.8, 0.9, True, 0.9)


def test_muloco_muon_step_has_the_scale_its_lr_was_tuned_for():
    from lowcomm.optim.grouping import muon_adamw

    _, cfg = validate_optimizer(_raw("muloco"))
    layer = torch.nn.Sequential(torch.nn.Linear(16, 48, bias=False))  # out/in = 3
    weight = layer[0].weight
    start = weight.detach().clone()
    weight.grad = torch.randn_like(weight)
    muon_adamw(layer, cfg).step()
    step = (weight.detach() - start * (1 - cfg.lr * cfg.weight_decay)).reshape(-1)
    # an orthogonalised 48 x 16 update has 16 singular values ~1, so RMS ~ sqrt(16 / 768), scaled
    # by lr sqrt(max(1, 48 / 16)); Moonlight's scale would be lr 0.2 sqrt(48) instead
    rms = step.pow(2).mean().sqrt().item()
    expected = cfg.lr * 3**0.5 * (16 / 768) ** 0.5
    assert expected * 0.7 < rms < expected * 1.3


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["optimizer=demo", "optimizer.compression_chunk=8", "optimizer.compression_topk=100"],
         "optimizer.compression_topk=100"),
        (["optimizer=demo", "optimizer.compression_chunk=8", "optimizer.compression_topk=64"],
         "optimizer.compression_topk=64"),
        (["optimizer=flexdemo", "optimizer.compression_chunk=4", "optimizer.compression_topk=16"],
         "optimizer.compression_topk=16"),
        (["optimizer=diloco", "compression=dct_topk", "compression.chunk=4", "compression.topk=20"],
         "compression.topk=20"),
    ],
)
def test_a_topk_not_smaller_than_the_block_is_a_config_error_naming_both(overrides, key):
    with pytest.raises(ConfigError) as raised:
        validate_optimizer(OmegaConf.to_container(compose(overrides), resolve=True))
    message = str(raised.value)
    chunk = next(o.split("=")[1] for o in overrides if "chunk=" in o)
    assert key in message and f"chunk={chunk}" in message


def test_a_topk_just_below_the_block_is_accepted():
    raw = OmegaConf.to_container(
        compose(["optimizer=demo", "optimizer.compression_chunk=8", "optimizer.compression_topk=63"]), resolve=True)
    assert validate_optimizer(raw)[1].compression_topk == 63
