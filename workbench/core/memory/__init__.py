"""Memory: counting live tensor bytes, enforcing a device budget, predicting and monitoring peaks.

    live_bytes  every live tensor's bytes per device, and the peak (a torch dispatch mode)
    accounting  bytes per category and phase of a training step, and where the peak is
    budget      a device budget: CUDA's memory fraction, or the CPU playing a card of N MiB
    monitor     a background sampler (NVML, torch.cuda, psutil, live bytes) feeding sinks
    plan        what changes about a step: the Plan, the named rungs, building a plan
    meta        a model without its weights: config, meta-device modules, parameter counts
    predict     the accounting over fake tensors: any config, any plan, no GPU
    cuda_model  what CUDA does differently (kernels, dropout masks, autocast) and the cards
    allocator   the CUDA caching allocator, modelled: allocated and reserved peaks of a timeline
    played      what a played card ('cpu@N:cuda') needs: the CPU's step through that allocator
    snapshot    the predicted or measured step as a PyTorch memory-visualizer snapshot
    baselines   accelerate's and DeepSpeed's estimators, called from the libraries

The package imports nothing itself: import the module you need.
"""
