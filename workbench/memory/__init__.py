"""Memory: counting live tensor bytes, enforcing a device budget, predicting and monitoring peaks."""

from workbench.memory.budget import DeviceBudget, device_budget
from workbench.memory.live_bytes import LiveBytes

__all__ = ["DeviceBudget", "LiveBytes", "device_budget"]
