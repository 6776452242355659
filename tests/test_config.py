"""Bad input is refused before anything is spawned, with a message naming the key and what is allowed."""

from __future__ import annotations

import copy
import dataclasses
import subprocess
import sys

import numpy as np
import pytest
import torch

from lowcomm.config import ConfigError, validate
from lowcomm.config.naming import changed_keys, derive_run_name, what_is_trained
from lowcomm.config.schema import TrainSpec
from lowcomm.strategies import STRATEGIES
from lowcomm.train.loop import compiles
from runs import tiny_run


def _error(tmp_path, *overrides, workers=2) -> str:
    with pytest.raises(ConfigError) as info:
        tiny_run(tmp_path, *overrides, workers=workers)
    return str(info.value)


@pytest.mark.slow
def test_unknown_group_option_names_the_group_and_the_choices(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "lowcomm.cli.train", "optimizer=adamw_nope", f"run_root={tmp_path}"],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )
    assert result.returncode != 0
    assert "optimizer/adamw_nope" in result.stderr and "adamw_ddp" in result.stderr
    assert not (tmp_path / "default").exists()  # nothing was launched


def test_global_batch_not_divisible_by_world_times_micro_batch(tmp_path):
    message = _error(tmp_path, "train.global_batch_size=10", "train.micro_batch_size=2", workers=4)
    assert "train.global_batch_size=10 is not divisible by world size x micro-batch = 4 x 2 = 8" in message


def test_sequence_length_above_the_models_maximum(tmp_path):
    message = _error(tmp_path, "train.seq_len=512")
    assert "train.seq_len=512 is above the model's maximum (model.max_sequence_length=256)" in message


@pytest.mark.parametrize("lr", ["0", "-1e-3"])
def test_learning_rate_must_be_positive(tmp_path, lr):
    assert "optimizer.lr must be > 0" in _error(tmp_path, f"optimizer.lr={lr}")


def test_missing_and_empty_data_paths(tmp_path):
    assert "data.paths is empty" in _error(tmp_path, "data=memmap", f"data.val_paths=[{tmp_path}/v.bin]")
    message = _error(tmp_path, "data=memmap", f"data.paths=[{tmp_path}/nothing_*.bin]", "data.val_paths=[]")
    assert f"data.paths: no file matches '{tmp_path}/nothing_*.bin'" in message
    assert "data.val_paths is empty" in message


def test_memmap_dtype_that_does_not_match_the_file_size(tmp_path):
    path = tmp_path / "tokens.bin"
    np.arange(99, dtype=np.uint16).tofile(path)  # 198 bytes: not a whole number of uint32
    message = _error(tmp_path, "data=memmap", f"data.paths=[{path}]", f"data.val_paths=[{path}]",
                     "data.dtype=uint32")
    assert f"data.dtype=uint32 does not match {path}" in message and "198 bytes" in message


def test_warmup_longer_than_the_run(tmp_path):
    assert "train.warmup_steps=50 must be in [0, train.max_steps=6]" in _error(tmp_path, "train.warmup_steps=50")


@pytest.mark.parametrize("max_steps, warmup", [(5, 0), (20, 2), (300, 30), (1000, 100)])
def test_the_default_warm_up_scales_with_the_run(tmp_path, max_steps, warmup):
    """Any train.max_steps works without touching the warm-up (5 steps failed before)."""
    run = tiny_run(tmp_path, "train.warmup_steps=null", max_steps=max_steps)
    assert run.train.warmup_steps == warmup
    assert run.raw["train"]["warmup_steps"] == warmup and "warmup_fraction" not in run.raw["train"]


def test_a_warm_up_stated_as_the_default_fraction_keeps_the_run_name(tmp_path):
    implicit = tiny_run(tmp_path, "train.warmup_steps=null", "train.warmup_fraction=0.5", max_steps=6)
    explicit = tiny_run(tmp_path, "train.warmup_steps=3", max_steps=6)
    assert implicit.run_name == explicit.run_name


def test_unknown_key_and_bad_choice_are_named(tmp_path):
    assert "train.max_stepz is not a key of train; did you mean train.max_steps?" in _error(
        tmp_path, "+train.max_stepz=3")
    assert "wandb.mode='sometimes' is not allowed; choose one of: offline, online, disabled" in _error(
        tmp_path, "wandb.mode=sometimes")


def test_every_problem_is_reported_at_once(tmp_path):
    message = _error(tmp_path, "optimizer.lr=0", "train.warmup_steps=50")
    assert "optimizer.lr" in message and "train.warmup_steps" in message


def test_run_names_are_deterministic_and_ignore_logistics(tmp_path):
    a = tiny_run(tmp_path, "train.log_every=3")
    b = tiny_run(tmp_path / "elsewhere", "train.log_every=5", "wandb.mode=offline")
    c = tiny_run(tmp_path, "optimizer.lr=1e-3")
    assert a.run_name == b.run_name
    assert a.run_name != c.run_name and a.run_name.startswith("tiny-adamw_ddp-w2-")


def test_weight_dtype_and_compile_are_checked(tmp_path):
    assert "train.param_dtype='fp16' is not allowed; choose one of: fp32, bf16" in _error(
        tmp_path, "train.param_dtype=fp16")
    assert "train.compile='yes' is not allowed; choose one of: true, false, auto" in _error(
        tmp_path, "train.compile=yes")


def test_auto_compiles_on_a_gpu_only_and_is_the_default():
    """train.compile=auto: compiled on a GPU (OLMo-300M's AdamW-DDP: 1.41x the eager tokens/s on
    an H200), eager on the CPU (the tiny model's first step compiles for 23 s, each later saves
    4 ms). The default since every method trained compiled as eager on an H200 (2026-11-28,
    tests/test_cuda_kernels.py)."""
    assert compiles("auto", torch.device("cuda", 0)) and not compiles("auto", torch.device("cpu"))
    assert compiles(True, torch.device("cpu")) and not compiles(False, torch.device("cuda", 0))
    assert TrainSpec().compile == "auto"


def test_keys_added_to_train_keep_the_names_of_runs_started_before_them():
    """A run named before train.param_dtype and train.compile existed keeps its name (and so
    finds its checkpoints) at their defaults; bf16 weights train something else, compile does not."""
    before = {"model": {"name": "tiny"}, "optimizer": {"name": "demo", "lr": 1e-3}, "compression": {"name": "none"},
              "seed": 0, "train": {"max_steps": 300, "precision": "auto", "log_every": 10}}
    with_defaults = copy.deepcopy(before)
    with_defaults["train"].update(param_dtype="fp32", compile=False)
    assert derive_run_name(with_defaults, 4) == derive_run_name(before, 4)
    for setting in (True, "auto"):
        compiled = copy.deepcopy(with_defaults)
        compiled["train"]["compile"] = setting
        assert derive_run_name(compiled, 4) == derive_run_name(before, 4)
        # how it runs: a resume may switch it without being refused as another run
        assert changed_keys(what_is_trained(compiled), what_is_trained(with_defaults)) == []
    graphed = {}  # DeMo's step as CUDA graphs: how it runs, as compile
    for setting in (False, True):
        graphed[setting] = copy.deepcopy(with_defaults)
        graphed[setting]["optimizer"]["cuda_graph"] = setting
        assert derive_run_name(graphed[setting], 4) == derive_run_name(before, 4)
    assert changed_keys(what_is_trained(graphed[False]), what_is_trained(graphed[True])) == []
    bf16 = copy.deepcopy(with_defaults)
    bf16["train"]["param_dtype"] = "bf16"
    assert derive_run_name(bf16, 4) != derive_run_name(before, 4)
    # a comparison of two configs (a sweep's jobs, a resume) still sees the weights' dtype
    assert changed_keys(what_is_trained(with_defaults), what_is_trained(bf16)) == ["train.param_dtype: 'fp32' -> 'bf16'"]
    assert changed_keys(what_is_trained(before), what_is_trained(with_defaults)) == []


@pytest.mark.parametrize("optimizer", ["adamw_ddp", "muon_ddp", "powersgd"])
def test_ddp_bucket_size_is_a_checked_setting_that_keeps_earlier_names(tmp_path, optimizer):
    """optimizer.bucket_cap_mb came after runs were named: at its default (25, torch's) a run
    keeps the name it had without it; another size is another run; 0 is refused."""
    at_default = tiny_run(tmp_path, f"optimizer={optimizer}")
    assert at_default.raw["optimizer"]["bucket_cap_mb"] == 25
    before = copy.deepcopy(at_default.raw)
    del before["optimizer"]["bucket_cap_mb"]
    assert derive_run_name(before, 2) == at_default.run_name
    larger = tiny_run(tmp_path, f"optimizer={optimizer}", "optimizer.bucket_cap_mb=100")
    assert larger.run_name != at_default.run_name
    for bad in ("0", "inf"):
        assert f"optimizer.bucket_cap_mb must be a finite number > 0 (MiB of gradients per DDP bucket), got {float(bad)}" \
            in _error(tmp_path, f"optimizer={optimizer}", f"optimizer.bucket_cap_mb={bad}")
    # the wall-clock model's overlap reads it: OLMo-300M's 1.28 GB in 49 buckets of 25 MiB, 13 of 100
    strategy = STRATEGIES[optimizer]
    assert strategy.comm_overlap(at_default.optimizer, 319_946_752) == pytest.approx(2 / 3 * 48 / 49)
    assert strategy.comm_overlap(larger.optimizer, 319_946_752) == pytest.approx(2 / 3 * 12 / 13)


def _keys_added_later() -> list[tuple[str, str]]:
    """(optimizer, key) for every registered strategy whose config has a key added since runs were
    saved (OPTIMIZER_KEYS_ADDED): a new strategy with such a key is covered without being listed."""
    from lowcomm.config.schema import OPTIMIZER_KEYS_ADDED

    return [(name, key) for name, strategy in sorted(STRATEGIES.items())
            for key in OPTIMIZER_KEYS_ADDED if key in {field.name for field in dataclasses.fields(strategy.Config)}]


@pytest.mark.parametrize("optimizer, key", _keys_added_later())
def test_a_run_config_saved_before_a_key_existed_loads_with_what_it_trained_with(tmp_path, optimizer, key):
    """A requeued job or lowcomm-wallclock reads a config.yaml written before ``optimizer.<key>``
    existed (DDP's bucket_cap_mb: 25 MiB; DeMo's bucket_numel: null, cuda_graph: false): it
    validates, with the value such a run used, under its name."""
    from omegaconf import OmegaConf

    from lowcomm.config import load_run_config
    from lowcomm.config.schema import OPTIMIZER_KEYS_ADDED

    run = tiny_run(tmp_path, f"optimizer={optimizer}")
    raw = copy.deepcopy(run.raw)
    del raw["optimizer"][key]
    path = tmp_path / "config.yaml"
    OmegaConf.save(OmegaConf.create(raw), path)
    upgraded = validate(load_run_config(path))
    assert getattr(upgraded.optimizer, key) == OPTIMIZER_KEYS_ADDED[key] and upgraded.run_name == run.run_name


def test_a_bad_cpu_kernel_switch_is_refused_before_anything_is_spawned(tmp_path, monkeypatch):
    monkeypatch.setenv("LOWCOMM_CPU_KERNELS", "maybe")
    assert "LOWCOMM_CPU_KERNELS='maybe': set it to 1" in _error(tmp_path)


def test_a_bad_slurm_profile_is_refused_by_validation_before_any_submission(tmp_path):
    message = _error(tmp_path, "cluster=slurm_debug", "cluster.gpus_per_node=4", "train.global_batch_size=8")
    assert "cluster.tasks_per_node (2) must equal cluster.gpus_per_node (4)" in message


# A newcomer's typos: every one is an error naming the key, the valid ones and the likely one.
@pytest.mark.parametrize("overrides, expected", [
    (["optimzer=demo"], "optimzer is not a key of the config; did you mean optimizer?"),
    (["+optimzer=demo"], "optimzer is not a key of the config; did you mean optimizer?"),
    (["optimizer=demo", "optimizer.topk=-1"],
     "optimizer.topk is not a key of optimizer=demo; did you mean optimizer.compression_topk?"),
    (["optimizer=demo", "+optimizer.topk=-1"],
     "optimizer.topk is not a key of optimizer=demo; did you mean optimizer.compression_topk?"),
    (["optimizer=adamw_nope"], "optimizer=adamw_nope: configs/optimizer/adamw_nope.yaml does not exist "
                               "(did you mean adamw_ddp?); choose one of: adamw_ddp, async_diloco, decoupled_diloco, demo,"),
    (["compression=topk", "compression.frac=0.1"], "did you mean compression.fraction?"),
    (["optimizer.lr=abc"], "optimizer.lr: Value 'abc' of type 'str' could not be converted to Float"),
    (["train.max_steps=many"], "train.max_steps: Value 'many' of type 'str' could not be converted to Integer"),
    # the papers' letters, as the docs write them (issue 45)
    (["optimizer=diloco", "optimizer.H=5"], "optimizer.H is not a key of optimizer=diloco; did you mean "
                                            "optimizer.sync_every?"),
    (["optimizer=demo", "optimizer.k=4"], "did you mean optimizer.compression_topk?"),
])
def test_typos_and_bad_types_name_the_key(tmp_path, overrides, expected):
    message = _error(tmp_path, *overrides)
    assert expected in message
    if "is not a key" in expected:
        assert "Valid keys:" in message


def test_an_unknown_key_added_with_plus_is_not_kept_silently(tmp_path):
    """Hydra accepts `+optimzer=demo` and would train AdamW-DDP with `optimzer: demo` stored."""
    message = _error(tmp_path, "+optimzer=demo")
    assert "optimzer" in message and "optimizer" in message
    assert not any(tmp_path.iterdir())  # nothing was written


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_optimizer_is_validated_before_anything_starts(tmp_path, capsys, name):
    from lowcomm.cli.train import main

    assert main([f"optimizer={name}", "optimizer.lr=-1", f"run_root={tmp_path}"]) == 2
    assert "optimizer.lr must be > 0, got -1" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_what_a_worker_would_refuse_is_refused_before_anything_starts(tmp_path, capsys):
    """FlexDeMo's sharding groups must tile the world: 3 workers in groups of 2 used to start
    3 processes and print one traceback each after a minute."""
    from lowcomm.cli.train import main

    code = main(["optimizer=flexdemo", "cluster.workers=3", "optimizer.shard_group_size=2",
                 "train.global_batch_size=12", "train.micro_batch_size=4", f"run_root={tmp_path}"])
    assert code == 2
    assert "optimizer.shard_group_size=2 must divide the world size 3" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # no run directory, no data: nothing was launched


# ------------------------------------------------------------------ composition in two steps, cached

HAND_WRITTEN = [
    ["seed=3", "optimizer=demo", "optimizer.compression_topk=8"],  # a value before its group
    ["experiment=paper_table1", "model=olmo_1b", "optimizer=diloco", "optimizer.sync_every=30"],
    ["experiment=quickstart", "data=memmap", "data.paths=[/a/*.npy,/b/c.npy]", "data.val_paths=[]"],
    ["optimizer=muloco", "+optimizer.extra=1", "++train.max_steps=7", "~wandb.project"],
    ["optimizer=sparseloco", "run_root=${oc.env:HOME}/runs", "train.eval_every=null"],
    ["cluster=slurm_64gpu", "model=tiny", "cluster.workers=4", "train.alpha_f=0.2"],
    ["optimizer.lr=0.1", "optimizer={lr: 0.2}"],  # a group's key given a mapping is a value, in order
]


def _shipped_jobs() -> list[list[str]]:
    """The first job of every shipped sweep and its last (the most values on one selection)."""
    from lowcomm.config.sweep import load_sweep
    from lowcomm.paths import repo_root
    jobs = []
    for path in sorted((repo_root() / "sweeps").glob("*.yaml")):
        sweep = load_sweep(str(path), labelled=False)
        jobs += [sweep.jobs[0], sweep.jobs[-1]]
    return jobs


@pytest.mark.slow
def test_composing_groups_then_values_is_hydras_single_composition():
    """compose() composes the group selections once and applies the values to a copy; Hydra's
    single call (the independent truth) gives the same config, flags included, for every shipped
    sweep's first and last job and for each kind of override."""
    from omegaconf import OmegaConf

    from lowcomm.config.compose import _hydra_compose, compose
    for overrides in HAND_WRITTEN + _shipped_jobs():
        ours, hydras = compose(overrides), _hydra_compose(overrides, whole=True)
        assert OmegaConf.to_container(ours) == OmegaConf.to_container(hydras), overrides
        assert OmegaConf.is_struct(ours) and OmegaConf.is_struct(hydras)
        assert list(ours.keys()) == list(hydras.keys())


def test_a_composed_config_changed_by_its_caller_does_not_change_the_next_one():
    from lowcomm.config.compose import compose
    first = compose(["optimizer=demo"])
    first.optimizer.compression_topk = 3
    assert compose(["optimizer=demo"]).optimizer.compression_topk != 3


def test_an_edited_config_tree_is_composed_afresh(tmp_path, monkeypatch):
    import os
    import shutil

    from lowcomm.config.compose import compose
    from lowcomm.paths import config_dir
    tree = tmp_path / "configs"
    shutil.copytree(config_dir(), tree)
    monkeypatch.setenv("LOWCOMM_CONFIG_DIR", str(tree))
    assert compose(["optimizer=demo", "seed=1"]).optimizer.compression_topk == 32
    demo = tree / "optimizer" / "demo.yaml"
    demo.write_text(demo.read_text().replace("compression_topk: 32", "compression_topk: 5"))
    os.utime(demo, ns=(1, 1))  # a new modification time even within the clock's resolution
    assert compose(["optimizer=demo", "seed=1"]).optimizer.compression_topk == 5


@pytest.mark.parametrize("overrides", [["optimizer=demo", "optimizer.nokey=1"], ["optimizer=demo,diloco"],
                                       ["hydra.job.name=x", "optimizer.nokey=1"]])
def test_a_bad_override_is_refused_by_either_path(overrides):
    from lowcomm.config.compose import compose
    with pytest.raises(ConfigError):
        compose(overrides)


def test_a_misspelt_optimizer_is_one_error_not_two(tmp_path):
    """optimizer=mulocco with MuLoCo's keys: the option is refused; its keys are not then checked
    against the default optimizer's (issue 45: a second, spurious "optimizer.sync_every is not a
    key of optimizer=adamw_ddp")."""
    message = _error(tmp_path, "optimizer=mulocco", "optimizer.sync_every=10")
    assert "optimizer=mulocco: configs/optimizer/mulocco.yaml does not exist (did you mean muloco?)" in message
    assert "sync_every" not in message and message.count("\n  - ") == 1, message
