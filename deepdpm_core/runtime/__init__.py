"""Where a fit runs: the communicator seam between ranks, devices and the timing of an epoch's
phases, number formats."""

from deepdpm_core.runtime.communicator import Communicator, LocalCommunicator
from deepdpm_core.runtime.devices import EPOCH_PHASES, device_clock, resolve_device
from deepdpm_core.runtime.precision import flush_denormals, net_precision, resolve_precision

__all__ = [
    "Communicator", "device_clock", "EPOCH_PHASES", "flush_denormals", "LocalCommunicator",
    "net_precision", "resolve_device", "resolve_precision"
]
