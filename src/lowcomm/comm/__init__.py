"""Metered collectives. Imports nothing else of lowcomm."""

from lowcomm.comm.communicator import Communicator, nbytes
from lowcomm.comm.meter import CommMeter

__all__ = ["CommMeter", "Communicator", "nbytes"]
