"""Optimizers as ``torch.optim.Optimizer`` subclasses that communicate through a Communicator."""

from lowcomm.optim.demo import DeMo, demo_payload_bytes
from lowcomm.optim.desloc import DESLoc
from lowcomm.optim.diloco import DiLoCo, all_gather_payloads

__all__ = ["DESLoc", "DeMo", "DiLoCo", "all_gather_payloads", "demo_payload_bytes"]
