"""Memory: counting live tensor bytes, enforcing a device budget, predicting and monitoring peaks.

    accounting  bytes per category and phase of a training step, and where the peak is
    predict     the same accounting over fake tensors: any config, any rung, no GPU
    ladder      the rungs (composed plans), measuring one, auto-fit with OOM step-down
    baselines   accelerate's and DeepSpeed's estimators, called from the libraries
    monitor     a background sampler (NVML, torch.cuda, psutil, live bytes) feeding sinks
    study       LadderConfig and run_ladder (study 2); cli: `workbench estimate`
"""

from workbench.core.memory.accounting import MemoryAccounting
from workbench.core.memory.budget import DeviceBudget, device_budget
from workbench.core.memory.live_bytes import LiveBytes
from workbench.core.memory.monitor import MemoryMonitor

__all__ = ["DeviceBudget", "LiveBytes", "MemoryAccounting", "MemoryMonitor", "device_budget"]
