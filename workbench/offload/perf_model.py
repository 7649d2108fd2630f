"""What would the split buy on a real GPU, when this machine has none? (every figure: modelled)

    m = machine("A100-80GB-PCIe", host="AMD-EPYC-7763", host_share=0.8)
    shape = model_shape("llama2-10b", seq_len=128)
    sim = simulate(shape, m, k=0.15, batch=8)         # one steady-state iteration, per layer
    pub = published_operating_point()                 # the seed's setting -> k

Rates: the accelerator's from a named profile (profiles.json: data-sheet figures times stated
efficiencies), the host's from a named host's data-sheet bandwidth times the share of
bandwidth the host Adam reaches on this machine (measured), or this machine's own rate.

The simulation walks one iteration layer by layer. Backward finishes layers in arrival order
(tied and input embeddings last); each host layer's gradient goes to the host (one copy
engine), is updated there (one host Adam, all cores), and its weights go back (the other copy
engine), each resource taking layers first come first served. The accelerator updates its
layers (the last to arrive) after backward. The next forward runs layer by layer, each layer
starting once its weights are back. The period is the time from one backward's start to the
next's, so throughput = tokens / period.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from workbench.offload.balance import Rates, balance_k
from workbench.offload.hostbench import ADAM_BYTES
from workbench.offload.layers import find_block_list, guessed_arrival_order, last_arriving, split_layers

PROFILES = Path(__file__).with_name("profiles.json")
CLAIMS = Path(__file__).resolve().parents[2] / "data" / "published_claims.json"
GB = 1e9

# Model shapes the model can be run for (transformers configs; built on the meta device).
SHAPES = {
    "llama2-10b": ("llama", dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=48,
                                 num_attention_heads=32, num_key_value_heads=32, vocab_size=32000)),
    "llama2-7b": ("llama", dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=32, vocab_size=32000)),
    "qwen2-0.5b": ("qwen2", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                 num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                 tie_word_embeddings=True)),
}


@functools.lru_cache(maxsize=1)
def _profiles() -> dict:
    return json.loads(PROFILES.read_text())


def load_profiles() -> tuple[dict, dict]:
    """(GPU profiles, host profiles) by name."""
    p = _profiles()
    return p["gpus"], p["hosts"]


def assumed(name: str):
    return _profiles()["assumed"][name]["value"]


def published_claims() -> dict:
    return json.loads(CLAIMS.read_text())["study3_split"]


# ---------------------------------------------------------------- model shapes
@dataclass
class Shape:
    """Per-layer sizes and work of a model, in the engine's own layer split."""

    name: str
    seq_len: int
    hidden: int
    n_blocks: int
    n_heads: int
    sizes: dict[str, int]  # layer -> parameters
    matmul: dict[str, int]  # layer -> parameters that take part in a matmul per token
    forward_order: list[str]
    arrival_order: list[str]
    blocks: set[str] = field(default_factory=set)  # the decoder blocks (attention work lives there)

    @property
    def n_params(self) -> int:
        return sum(self.sizes.values())

    def flops_per_token(self) -> float:
        """6 x matmul parameters + attention scores and values (12 x layers x hidden x seq)."""
        return 6.0 * sum(self.matmul.values()) + 12.0 * self.n_blocks * self.hidden * self.seq_len


def shape_from_model(model: torch.nn.Module, name: str, seq_len: int) -> Shape:
    cfg = model.config
    layers = split_layers(model)
    sizes = {l.name: l.numel for l in layers}
    emb = model.get_input_embeddings().weight
    matmul = {}
    for l in layers:
        n = 0
        for _, p in l.params:
            if p is emb and not l.tied:
                continue  # an untied input embedding is a lookup, no matmul
            if p.dim() >= 2:
                n += p.numel()
        matmul[l.name] = n
    found = find_block_list(model)
    blocks = {l.name for l in layers if found and l.name.startswith(found[0] + ".")}
    return Shape(name, seq_len, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
                 sizes, matmul, [l.name for l in layers], guessed_arrival_order(layers), blocks)


@functools.lru_cache(maxsize=None)
def model_shape(name: str, seq_len: int) -> Shape:
    import transformers

    family, kw = SHAPES[name]
    if family == "llama":
        cfg, cls = transformers.LlamaConfig(**kw), transformers.LlamaForCausalLM
    else:
        cfg, cls = transformers.Qwen2Config(**kw), transformers.Qwen2ForCausalLM
    with torch.device("meta"):  # shapes only: no memory, no weights
        model = cls(cfg)
    return shape_from_model(model, name, seq_len)


# ---------------------------------------------------------------- machines
@dataclass
class Machine:
    """Modelled rates of one accelerator + host pair (seconds per unit)."""

    gpu: str
    host: str
    fwd_bwd_flops_per_s: float
    accel_s_per_param: float  # accelerator Adam
    host_s_per_param: float  # host Adam
    d2h_s_per_byte: float
    h2d_s_per_byte: float
    memory_bytes: float
    notes: dict = field(default_factory=dict)

    @property
    def alpha(self) -> float:
        return self.accel_s_per_param / self.host_s_per_param


def machine(gpu: str, host: str = "AMD-EPYC-7763", *, host_share: float | None = None,
            host_s_per_param: float | None = None, alpha: float | None = None,
            fwd_bwd_tflops: float | None = None) -> Machine:
    """Rates for `gpu` (a profile) with `host`: a profile (needs host_share, the bandwidth share
    measured here) or 'this-machine' (needs host_s_per_param, measured here). `alpha` fixes the
    host rate from the accelerator's instead; `fwd_bwd_tflops` replaces peak x efficiency."""
    gpus, hosts = load_profiles()
    g = gpus[gpu]
    accel = ADAM_BYTES / (g["hbm_gb_per_s"] * GB * assumed("hbm_adam_efficiency"))
    notes = {"accelerator update": "data-sheet HBM x assumed efficiency"}
    if alpha is not None:
        host_rate = accel / alpha
        notes["host update"] = f"accelerator update / alpha (alpha={alpha:g})"
    elif host == "this-machine":
        if host_s_per_param is None:
            raise ValueError("host='this-machine' needs host_s_per_param measured here")
        host_rate = host_s_per_param
        notes["host update"] = "measured on this machine"
    else:
        if host_share is None:
            raise ValueError("a host profile needs host_share (the host Adam's share of bandwidth)")
        host_rate = ADAM_BYTES / (hosts[host]["memory_gb_per_s"] * GB * host_share)
        notes["host update"] = f"data-sheet bandwidth x host Adam bandwidth share {host_share:.2f}"
    link = g["host_link_gb_per_s_both_ways"] / 2 * GB * assumed("link_efficiency")
    flops = (fwd_bwd_tflops * 1e12 if fwd_bwd_tflops
             else g["bf16_dense_tflops"] * 1e12 * assumed("matmul_efficiency"))
    notes["forward/backward"] = "given rate" if fwd_bwd_tflops else "data-sheet peak x assumed efficiency"
    return Machine(gpu, host, flops, accel, host_rate, 1 / link, 1 / link, g["memory_gb"] * GB, notes)


# ---------------------------------------------------------------- one iteration, per layer
def times(shape: Shape, m: Machine, batch: int) -> dict:
    """Forward and backward time per layer (backward = 2 x forward; per-layer share by matmul
    work, attention spread over the blocks)."""
    tokens = batch * shape.seq_len
    attn = 12.0 * shape.hidden * shape.seq_len  # per token per block, forward+backward
    work = {}
    for name, n in shape.matmul.items():
        work[name] = 6.0 * n + (attn if name in shape.blocks else 0.0)
    total = sum(work.values())
    t_fb = tokens * shape.flops_per_token() / m.fwd_bwd_flops_per_s
    t_f, t_b = t_fb / 3.0, 2.0 * t_fb / 3.0
    share = {k: v / total for k, v in work.items()}
    return {"t_forward_s": t_f, "t_backward_s": t_b, "share": share, "tokens": tokens}


def rates(shape: Shape, m: Machine, batch: int) -> Rates:
    """The balance formula's inputs for this model on this machine."""
    t = times(shape, m, batch)
    n = shape.n_params
    return Rates(t["t_backward_s"], n * m.host_s_per_param, m.alpha,
                 t_to_host_s=n * assumed("grad_bytes") * m.d2h_s_per_byte,
                 t_to_accel_s=n * assumed("weight_bytes") * m.h2d_s_per_byte,
                 copies_overlap=True)  # copy engines run beside the host Adam


def accel_memory_bytes(shape: Shape, batch: int, k_actual: float, mode: str) -> float:
    """Accelerator memory: bf16 weights, the largest layer's gradients in flight, master
    (fp32) + Adam moments + fp32 gradient for its own share, and activations."""
    n = shape.n_params
    act = (assumed("activation_bytes_per_token_per_layer_per_hidden") * batch * shape.seq_len * shape.hidden
           + 5 * shape.n_heads * shape.seq_len**2 * batch) * shape.n_blocks
    if mode == "all-accelerator":
        return n * (2 + 2 + 4 + 8) + act
    largest = max(shape.sizes.values())
    return n * 2 + 2 * largest * 2 + k_actual * n * (4 + 8 + 4) + act


def k_max_for_memory(shape: Shape, batch: int, memory_bytes: float) -> float:
    """The largest accelerator share whose fp32 master + Adam state still fit (16 B/param)."""
    free = memory_bytes - accel_memory_bytes(shape, batch, 0.0, "split")
    return min(1.0, max(0.0, free / (16.0 * shape.n_params)))


def simulate(shape: Shape, m: Machine, k: float, batch: int, mode: str = "split") -> dict:
    """One steady-state iteration. mode: 'split' (host updates overlap backward),
    'zero-offload' (all on the host, updates after backward), 'all-accelerator'."""
    t = times(shape, m, batch)
    t_f, t_b, share = t["t_forward_s"], t["t_backward_s"], t["share"]
    sizes, order = shape.sizes, shape.arrival_order
    if mode == "all-accelerator":
        accel, k_act = set(order), 1.0
    elif mode == "zero-offload":
        accel, k_act = set(), 0.0
    else:
        accel, k_act = last_arriving(order, sizes, k)
    gb, wb = assumed("grad_bytes"), assumed("weight_bytes")
    events = [("accelerator", "backward", "backward", 0.0, t_b)]
    ready, clock = {}, 0.0
    for name in order:  # backward: when each layer's gradient is final
        clock += t_b * share[name]
        ready[name] = clock
    back, d2h, cpu, h2d = {}, 0.0, 0.0, 0.0
    host_done_in_bwd = 0
    for name in order:
        if name in accel:
            continue
        n = sizes[name]
        s = max(ready[name], d2h)
        d2h = s + n * gb * m.d2h_s_per_byte
        events.append(("transfer to host", "to host", name, s, d2h))
        s = max(d2h, cpu, t_b if mode == "zero-offload" else 0.0)
        cpu = s + n * m.host_s_per_param
        events.append(("host", "host update", name, s, cpu))
        host_done_in_bwd += n if cpu <= t_b else 0
        s = max(cpu, h2d)
        h2d = s + n * wb * m.h2d_s_per_byte
        events.append(("transfer to accelerator", "to accelerator", name, s, h2d))
        back[name] = h2d
    clock = t_b
    for name in order:  # the accelerator's own share, after backward
        if name in accel:
            s, clock = clock, clock + sizes[name] * m.accel_s_per_param
            events.append(("accelerator", "accelerator update", name, s, clock))
            back[name] = clock
    accel_busy = t_f + t_b + (clock - t_b)
    for name in shape.forward_order:  # next forward, each layer once its weights are back
        s = max(clock, back[name])
        clock = s + t_f * share[name]
        events.append(("accelerator", "forward (next)", name, s, clock))
    period = clock
    host_n = sum(sizes[nm] for nm in order if nm not in accel)
    mem = accel_memory_bytes(shape, batch, k_act, mode)
    return {
        "mode": mode,
        "k_target": k if mode == "split" else k_act,
        "k_actual": k_act,
        "iteration_ms": period * 1e3,
        "tokens_per_s": t["tokens"] / period,
        "tflops": t["tokens"] * shape.flops_per_token() / period / 1e12,
        "accel_idle_share": max(0.0, 1.0 - accel_busy / period),
        "host_done_before_bwd_end_share": host_done_in_bwd / host_n if host_n else float("nan"),
        "forward_ms": t_f * 1e3,
        "backward_ms": t_b * 1e3,
        "accel_memory_gib": mem / 2**30,
        "fits": mem <= m.memory_bytes,
        "events": [{"lane": l, "activity": a, "what": w, "start_ms": s * 1e3, "end_ms": e * 1e3}
                   for l, a, w, s, e in events],
    }


def best_static_k(shape: Shape, m: Machine, batch: int, points: int = 101) -> float:
    """The k of the simulated static sweep with the highest throughput (memory not checked)."""
    ks = [i / (points - 1) for i in range(points)]
    return max(ks, key=lambda k: simulate(shape, m, k, batch)["tokens_per_s"])


# ---------------------------------------------------------------- the seed's operating point
def published_operating_point(seq_len: int | None = None) -> dict:
    """k for the seed's setting: its alpha, model, batch, GPU and throughput (read from
    data/published_claims.json), completed by profiles.json's stated assumptions."""
    claims = published_claims()
    setting = _profiles()["published_setting"]
    seq = seq_len or setting["seq_len"]["value"]
    alpha = claims["claims"]["alpha"]
    shape = model_shape(setting["model"]["value"], seq)
    m = machine(setting["gpu"]["value"], alpha=alpha, fwd_bwd_tflops=claims["claims"]["throughput_tflops"])
    batch = claims["setup"]["batch"]
    r = rates(shape, m, batch)
    return {
        "gpu": m.gpu,
        "model": shape.name,
        "n_params": shape.n_params,
        "batch": batch,
        "seq_len": seq,
        "alpha": alpha,
        "t_backward_s": r.t_backward_s,
        "t_update_host_s": r.t_update_host_s,
        "t_transfer_s": r.t_transfer_s,
        "implied_host_adam_gb_per_s": ADAM_BYTES / m.host_s_per_param / GB,
        "k_seed_formula": balance_k(r, include_transfer=False),
        "k_with_transfer": balance_k(r, include_transfer=True),
        "k_best_simulated": best_static_k(shape, m, batch),
        "k_band": tuple(claims["claims"]["k_range"]),
    }


def published_sensitivity(seq_lens=(64, 96, 112, 120, 128, 136, 144, 160, 192, 256)) -> list[dict]:
    """k of the seed's setting against the one figure the seed leaves out, the sequence length."""
    rows = []
    for s in seq_lens:
        op = published_operating_point(s)
        rows.append({"seq_len": s, "k_seed_formula": op["k_seed_formula"],
                     "k_with_transfer": op["k_with_transfer"], "k_best_simulated": op["k_best_simulated"],
                     "t_backward_s": op["t_backward_s"], "t_update_host_s": op["t_update_host_s"]})
    return rows
