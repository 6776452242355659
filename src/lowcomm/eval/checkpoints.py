"""Read-only access to a run directory's model checkpoints, for evaluation.

A run directory holds ``config.yaml`` (the resolved Hydra config; its ``model`` key is a
:class:`~lowcomm.models.ModelSpec`) and ``checkpoints/step_000000100/`` directories. A checkpoint
directory is complete when its ``manifest.json`` exists: the training loop writes it last, after
every file it lists (name -> size in bytes), and only then renames the directory into place.
``model.pt`` is always the full, unsharded fp32 model ``state_dict``.

The layout itself (step directory names, the manifest check) is read through
:mod:`lowcomm.rundir`, the one place it is defined.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from lowcomm.models import ModelSpec, build_model
from lowcomm.rundir import (
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    MANIFEST_FILE,
    MODEL_FILE,
    CheckpointError,
    list_checkpoints,
    step_dir_name,
    verify_files,
)

__all__ = ["CONFIG_FILE", "CheckpointError", "step_dir_name"]


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint directory of one run."""

    run_dir: Path
    step: int
    path: Path

    @property
    def model_file(self) -> Path:
        return self.path / MODEL_FILE


def list_complete_checkpoints(run_dir: str | Path) -> list[Checkpoint]:
    """The run's complete checkpoints (those with a manifest), oldest first.

    Directories being written (``.tmp_step_*``) and ``step_*`` directories without a manifest
    (a save interrupted before the rename, or a copy still in flight) are skipped.
    """
    run_dir = Path(run_dir)
    found = [Checkpoint(run_dir=run_dir, step=int(entry.name.split("_")[1]), path=entry)
             for entry in list_checkpoints(run_dir / CHECKPOINTS_DIR) if (entry / MANIFEST_FILE).is_file()]
    return found[::-1]


def select_checkpoints(
    run_dir: str | Path, step: int | None = None, all_checkpoints: bool = False
) -> list[Checkpoint]:
    """The latest complete checkpoint, the one at ``step``, or every complete one (oldest first)."""
    if step is not None and all_checkpoints:
        raise ValueError("choose either a step or all checkpoints, not both")
    complete = list_complete_checkpoints(run_dir)
    if not complete:
        raise CheckpointError(
            f"{Path(run_dir) / CHECKPOINTS_DIR} holds no complete checkpoint (a step_* directory with {MANIFEST_FILE})"
        )
    if all_checkpoints:
        return complete
    if step is None:
        return [complete[-1]]
    for checkpoint in complete:
        if checkpoint.step == step:
            return [checkpoint]
    available = ", ".join(str(checkpoint.step) for checkpoint in complete)
    raise CheckpointError(
        f"{Path(run_dir) / CHECKPOINTS_DIR / step_dir_name(step)} is not a complete checkpoint; "
        f"complete steps: {available}"
    )


def load_model_spec(run_dir: str | Path) -> ModelSpec:
    """The ``model`` section of ``<run_dir>/config.yaml`` as a validated :class:`ModelSpec`."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    config_path = Path(run_dir) / CONFIG_FILE
    if not config_path.is_file():
        raise CheckpointError(f"{config_path} is missing: not a lowcomm run directory")
    try:
        config = OmegaConf.load(config_path)
    except (OmegaConfBaseException, ValueError, OSError) as exc:
        raise CheckpointError(f"{config_path} cannot be read: {exc}") from exc
    if "model" not in config:
        raise CheckpointError(f"{config_path} has no 'model' section")
    fields = OmegaConf.to_container(config.model, resolve=True)
    try:
        spec = ModelSpec(**fields)
    except TypeError as exc:
        raise CheckpointError(f"{config_path}: 'model' does not match lowcomm's ModelSpec: {exc}") from exc
    if errors := spec.validate():
        raise CheckpointError(f"{config_path}: " + "; ".join(errors))
    return spec


def verify_manifest(checkpoint: Checkpoint, required: Sequence[str] = (MODEL_FILE,)) -> dict:
    """The parsed manifest, after checking that the ``required`` files are listed, present and of
    the recorded size."""
    return verify_files(checkpoint.path, only=tuple(required))


def load_checkpoint_model(
    checkpoint: Checkpoint, device: str | torch.device = "cpu", spec: ModelSpec | None = None
) -> torch.nn.Module:
    """The run's model with the checkpoint's weights, in eval mode on ``device``."""
    spec = spec if spec is not None else load_model_spec(checkpoint.run_dir)
    verify_manifest(checkpoint)
    try:
        state_dict = torch.load(checkpoint.model_file, map_location=device, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means an unusable file
        raise CheckpointError(f"{checkpoint.model_file} cannot be loaded: {exc}") from exc
    # The weights are overwritten right away, so the seeded initialisation is skipped.
    model = build_model(spec, device, seed=None)
    misfit = _misfit(state_dict, model.state_dict()) if isinstance(state_dict, dict) else None
    if misfit:
        raise CheckpointError(f"{checkpoint.model_file} does not fit model={spec.name} of "
                              f"{checkpoint.run_dir / CONFIG_FILE}: {misfit}; was it written by another run?")
    try:
        model.load_state_dict(state_dict)
    except (RuntimeError, TypeError, AttributeError) as exc:  # what _misfit does not foresee: not a state dict
        raise CheckpointError(f"{checkpoint.model_file} does not fit model={spec.name} of "
                              f"{checkpoint.run_dir / CONFIG_FILE}: {' '.join(str(exc).split())[:300]}") from exc
    return model.eval()


def _misfit(saved: dict, expected: dict) -> str | None:
    """How a checkpoint's tensors differ from a model's, in one clause: how many differ in
    shape, the first of them, and the names only one of the two has; None where they fit."""
    shapes = [(name, tuple(saved[name].shape), tuple(tensor.shape)) for name, tensor in expected.items()
              if name in saved and tuple(saved[name].shape) != tuple(tensor.shape)]
    missing, unexpected = sorted(set(expected) - set(saved)), sorted(set(saved) - set(expected))
    parts = []
    if shapes:
        name, theirs, ours = shapes[0]
        parts.append(f"{len(shapes)} of its {len(saved)} tensors have other shapes (first {name}: {theirs} in the "
                     f"checkpoint, {ours} in the model)")
    if missing:
        parts.append(f"{len(missing)} of the model's tensors are missing (first {missing[0]})")
    if unexpected:
        parts.append(f"{len(unexpected)} are not the model's (first {unexpected[0]})")
    return "; ".join(parts) or None
