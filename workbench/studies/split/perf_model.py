"""What would the split buy on a real GPU, when this machine has none? (every figure: modelled)

    host = measure_host()                                # this machine, one thread (hostbench)
    m = machine("A100-80GB-PCIe", host="AMD-EPYC-7763", host_meas=host)
    shape = model_shape("llama2-10b", seq_len=128)
    sim = simulate(shape, m, k=0.15, batch=8)            # one steady-state iteration, per layer
    verdict = seed_verdict(host)                         # for which settings the seed's k band holds
    table = validate(host)                               # against published offload measurements

Inputs, each with its source in profiles.json, none of them a figure the model is compared with:
- accelerator compute: the data-sheet dense peak x a model-FLOPs utilisation stated by a named
  public source (Megatron-LM's MFU table for the A100; its V1.0 blog for the V100);
- accelerator Adam: data-sheet HBM bandwidth x a stated streaming efficiency;
- host Adam: a bandwidth model of the named host. Per socket, all cores together pull
  min(cores x b_core, f x B_socket): b_core is what one core pulls in Adam's access pattern,
  measured here on one thread; B_socket the data sheet's channels x transfer rate; f the stated
  share of it that streaming kernels sustain. A 64-core socket is thus bandwidth-bound (64 x
  b_core is far above f x B_socket), not 64 times one core. The host Adam reaches a share s of
  that bandwidth: Adam's bytes/s over the Adam-pattern probe's, measured here, clipped to 1.
  Host Adam bytes/s = s x sockets x min(cores x b_core, f x B_socket);
- the host link: the data sheet's PCIe figure per direction x a stated efficiency.

The seed's own figures (alpha 0.083, k in [0.1, 0.2], 23 TFLOP/s) are what the model is compared
with (`seed_verdict`), never inputs; published measurements of offload systems check the model
(`validate`), and the error of each is reported.

The simulation walks one iteration layer by layer. Backward finishes layers in arrival order
(tied and input embeddings last); each host layer's gradient goes to the host (one copy
engine), is updated there (one host Adam, all cores), and its weights go back (the other copy
engine), each resource taking layers first come first served. The accelerator updates its
layers (the last to arrive) after backward. The next forward runs layer by layer, each layer
starting once its weights are back. The period is the time from one backward's start to the
next's, so throughput = tokens / period.

Why one module over 400 lines: the profiles, the per-layer schedule simulation, the verdict and
the validation are one model with one set of inputs; the validation must run exactly the code the
study's modelled rows run.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from workbench.core.common import PROJECT_ROOT, figure_text
from workbench.core.memory.cuda_model import CONTEXT_BYTES
from workbench.studies.split.balance import Rates, balance_k
from workbench.studies.split.hostbench import ADAM_BYTES, measure_host
from workbench.studies.split.layers import find_block_list, guessed_arrival_order, last_arriving, split_layers

PROFILES = Path(__file__).with_name("profiles.json")
CLAIMS = PROJECT_ROOT / "data" / "published_claims.json"
GB = 1e9  # rates (GB/s) are decimal on every data sheet
GIB = 2**30  # a card's memory is binary: an "80 GB" A100 shows 81,920 MiB; the CUDA context is counted in
# accel_memory_bytes (cuda_model's modelled constant)

# Model shapes the model can be run for (transformers configs; built on the meta device).
SHAPES = {
    "llama2-10b": ("llama", dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=48,
                                 num_attention_heads=32, num_key_value_heads=32, vocab_size=32000)),
    "llama2-7b": ("llama", dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=32, vocab_size=32000)),
    "gpt2-10b": ("gpt2", dict(n_embd=4096, n_layer=50, n_head=32, vocab_size=50257, n_positions=1024)),
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


def mfu_of(gpu: str) -> tuple[float | None, str]:
    """(model-FLOPs utilisation, its source) for a GPU profile."""
    key = load_profiles()[0][gpu].get("mfu")
    if key is None:
        return None, "no MFU source for this card"
    entry = _profiles()["mfu"][key]
    return entry["value"], entry["source"]


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
    vocab: int = 0  # the output head's size (the loss's logits are batch x seq x vocab)

    @property
    def n_params(self) -> int:
        return sum(self.sizes.values())

    def flops_per_token(self, recompute: bool = False) -> float:
        """6 x matmul parameters + attention scores and values (12 x layers x hidden x seq); with
        activation recomputation the forward runs twice: 8 x and 16 x."""
        f = 8.0 if recompute else 6.0
        return f * sum(self.matmul.values()) + 2 * f * self.n_blocks * self.hidden * self.seq_len


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
                 sizes, matmul, [l.name for l in layers], guessed_arrival_order(layers), blocks, cfg.vocab_size)


@functools.lru_cache(maxsize=None)
def _base_shape(name: str) -> Shape:
    import transformers

    family, kw = SHAPES[name]
    if family == "llama":
        cfg, cls = transformers.LlamaConfig(**kw), transformers.LlamaForCausalLM
    elif family == "gpt2":
        cfg, cls = transformers.GPT2Config(**kw), transformers.GPT2LMHeadModel
    else:
        cfg, cls = transformers.Qwen2Config(**kw), transformers.Qwen2ForCausalLM
    with torch.device("meta"):  # shapes only: no memory, no weights
        model = cls(cfg)
    shape = shape_from_model(model, name, 0)
    if family == "gpt2":  # GPT2Config names its sizes differently
        shape.hidden, shape.n_blocks, shape.n_heads = kw["n_embd"], kw["n_layer"], kw["n_head"]
    return shape


def model_shape(name: str, seq_len: int) -> Shape:
    """The shape of a named model (built once on the meta device) at a sequence length."""
    return dataclasses.replace(_base_shape(name), seq_len=seq_len)


# ---------------------------------------------------------------- machines
def host_bandwidth(host: str, per_core_bytes_per_s: float) -> tuple[float, str]:
    """(bytes/s all sockets of `host` move in Adam's pattern, how): per socket
    min(cores x per-core bandwidth, sustained fraction x data-sheet bandwidth)."""
    h = load_profiles()[1][host]
    f = assumed("sustained_bandwidth_fraction")
    cores = h["cores_per_socket"] * per_core_bytes_per_s
    socket = f * h["memory_gb_per_s_per_socket"] * GB
    per_socket = min(cores, socket)
    bound = "core-bound" if cores < socket else "socket-bound"
    how = (f"{h['sockets']} x min({h['cores_per_socket']} cores x {per_core_bytes_per_s / GB:.1f} GB/s, "
           f"{f:g} x {h['memory_gb_per_s_per_socket']:g} GB/s) = {h['sockets'] * per_socket / GB:.0f} GB/s ({bound})")
    return h["sockets"] * per_socket, how


@dataclass
class Machine:
    """Modelled rates of one accelerator + host pair (seconds per unit)."""

    gpu: str
    host: str
    fwd_bwd_flops_per_s: float
    accel_s_per_param: float  # accelerator Adam
    host_s_per_param: float  # host Adam (fp32, 28 B/param)
    d2h_s_per_byte: float
    h2d_s_per_byte: float
    memory_bytes: float
    notes: dict = field(default_factory=dict)

    @property
    def alpha(self) -> float:
        return self.accel_s_per_param / self.host_s_per_param

    @property
    def host_s_per_byte(self) -> float:
        return self.host_s_per_param / ADAM_BYTES


def machine(gpu: str, host: str = "AMD-EPYC-7763", *, host_meas: dict | None = None,
            host_share: float | None = None, alpha: float | None = None, mfu: float | None = None) -> Machine:
    """Rates for `gpu` (a profile) with `host`: a host profile, modelled from `host_meas` (what
    hostbench.measure_host measured here on one thread: the Adam share of the Adam-pattern probe
    and the per-core bandwidth), or 'this-machine' (the host Adam rate measured here).
    `host_share` replaces the measured share, `alpha` fixes the host rate from the accelerator's
    and `mfu` replaces the profile's model-FLOPs utilisation (what-ifs; none is used for the
    published comparison)."""
    gpus, hosts = load_profiles()
    g = gpus[gpu]
    accel = ADAM_BYTES / (g["hbm_gb_per_s"] * GB * assumed("hbm_adam_efficiency"))
    notes = {"accelerator update": f"data-sheet HBM {g['hbm_gb_per_s']} GB/s x {assumed('hbm_adam_efficiency')}"}
    if alpha is not None:
        host_rate = accel / alpha
        notes["host update"] = f"accelerator update / alpha (alpha={alpha:g}, given)"
        notes["host share"] = "not used (alpha given)"
    elif host == "this-machine":
        if not host_meas:
            raise ValueError("host='this-machine' needs host_meas (measured here)")
        host_rate = host_meas["adam_s_per_param"]
        notes["host update"] = "measured on this machine"
        notes["host share"] = "not used (host rate measured here)"
    else:
        if not host_meas and host_share is None:
            raise ValueError("a host profile needs host_meas (hostbench.measure_host) or host_share")
        share = host_share if host_share is not None else min(1.0, host_meas["bandwidth_share"])
        per_core = (host_meas or {}).get("per_core_bytes_per_s") or hosts[host]["memory_gb_per_s_per_socket"] * GB
        bw, how = host_bandwidth(host, per_core)
        host_rate = ADAM_BYTES / (bw * share)
        # the product stated: "share 0.82 x 1 x min(...) = 164 GB/s" read as if 164 were the rate used (135)
        notes["host update"] = f"share {share:.2f} x ({how}) = {figure_text(bw * share / GB)} GB/s"  # as the table
        notes["host share"] = "config" if host_share is not None else "measured here"
    link = g["host_link_gb_per_s_both_ways"] / 2 * GB * assumed("link_efficiency")
    used_mfu, src = (mfu, "given") if mfu is not None else mfu_of(gpu)
    flops = g["bf16_dense_tflops"] * 1e12 * used_mfu if (used_mfu and g["bf16_dense_tflops"]) else float("nan")
    notes["forward/backward"] = f"data-sheet {g['bf16_dense_tflops']} TFLOP/s x MFU {used_mfu} ({src})"
    notes["mfu"] = used_mfu
    return Machine(gpu, host, flops, accel, host_rate, 1 / link, 1 / link, g["memory_gb"] * GIB, notes)


# ---------------------------------------------------------------- one iteration, per layer
def times(shape: Shape, m: Machine, batch: int, recompute: bool = False) -> dict:
    """Forward and backward time per layer (backward = 2 x forward, + 1 forward when activations
    are recomputed; per-layer share by matmul work, attention spread over the blocks)."""
    tokens = batch * shape.seq_len
    attn = 12.0 * shape.hidden * shape.seq_len  # per token per block, forward+backward
    work = {}
    for name, n in shape.matmul.items():
        work[name] = 6.0 * n + (attn if name in shape.blocks else 0.0)
    total = sum(work.values())
    t_fb = tokens * shape.flops_per_token(recompute) / m.fwd_bwd_flops_per_s
    t_f = t_fb / (4.0 if recompute else 3.0)
    t_b = t_fb - t_f
    share = {k: v / total for k, v in work.items()}
    return {"t_forward_s": t_f, "t_backward_s": t_b, "share": share, "tokens": tokens}


def rates(shape: Shape, m: Machine, batch: int, recompute: bool = False) -> Rates:
    """The balance formula's inputs for this model on this machine (with activation recompute, the
    backward the host overlaps with includes the recomputed forward)."""
    t = times(shape, m, batch, recompute)
    n = shape.n_params
    return Rates(t["t_backward_s"], n * m.host_s_per_param, m.alpha,
                 t_to_host_s=n * assumed("grad_bytes") * m.d2h_s_per_byte,
                 t_to_accel_s=n * assumed("weight_bytes") * m.h2d_s_per_byte,
                 copies_overlap=True)  # copy engines run beside the host Adam


def activation_bytes(shape: Shape, batch: int, recompute: bool = False) -> float:
    """bf16 activations kept for backward (Korthikanti et al. 2022, "Reducing Activation
    Recomputation in Large Transformer Models", section 4 and Table 2): 34sbh + 5as^2b bytes per
    block without recomputation; with full recomputation each block keeps only its input, 2sbh,
    and one block's full activations are rebuilt at a time during backward (counted here; the
    paper's table leaves that one block out)."""
    s, b, h = shape.seq_len, batch, shape.hidden
    block = assumed("activation_bytes_per_token_per_layer_per_hidden") * s * b * h + 5 * shape.n_heads * s**2 * b
    return 2 * s * b * h * shape.n_blocks + block if recompute else block * shape.n_blocks


def logits_bytes(shape: Shape, batch: int) -> float:
    """The loss's tensors when the forward ends, beside every activation: the bf16 logits, the fp32
    copy transformers' ForCausalLMLoss makes (`logits.float()`) and log-softmax's fp32 output, which
    cross-entropy keeps for backward: 2 + 4 + 4 bytes per token per vocabulary entry."""
    return 10.0 * batch * shape.seq_len * shape.vocab


# a card-side parameter's bytes in the split (engine.SplitEngine on a card): its fp32 master and Adam's
# two moments, and its bf16 gradient, kept from its backward to the update after backward. Its fp32
# gradient is made one parameter at a time there (the largest's: 4 bytes a parameter of it, once).
# Until 2026-12-02 the share was 16 (an fp32 gradient for each): 2 bytes a parameter of k too many,
# and at k = 1 two more than the all-accelerator run (2 + 2 + 4 + 8) that holds the same.
ACCEL_SHARE_BYTES = 4 + 8 + 2


def accel_memory_bytes(shape: Shape, batch: int, k_actual: float, mode: str, recompute: bool = False) -> float:
    """Accelerator memory: bf16 weights, the largest layer's gradients in flight to the host, for the
    card's own share k its master, Adam moments and bf16 gradient (ACCEL_SHARE_BYTES) and one fp32
    gradient of the largest layer, activations, the loss's logits and the CUDA context
    (workbench.core.memory.cuda_model's modelled constant)."""
    n = shape.n_params
    rest = activation_bytes(shape, batch, recompute) + logits_bytes(shape, batch) + CONTEXT_BYTES
    if mode == "all-accelerator":
        return n * (2 + 2 + 4 + 8) + rest
    largest = max(shape.sizes.values())
    share = k_actual * n * ACCEL_SHARE_BYTES + (4 * largest if k_actual > 0 else 0)
    return n * 2 + 2 * largest * 2 + share + rest


def k_max_for_memory(shape: Shape, batch: int, memory_bytes: float, recompute: bool = False) -> float:
    """The largest accelerator share whose fp32 master, Adam state and bf16 gradient (ACCEL_SHARE_BYTES)
    still fit beside the rest and one fp32 gradient, in whole layers: those `simulate` places there (the
    last to arrive), so a run at this k fits. 0.0 where even k = 0 does not fit (simulate then says so)."""
    free = memory_bytes - accel_memory_bytes(shape, batch, 0.0, "split", recompute) - 4 * max(shape.sizes.values())
    held = 0
    for name in reversed(shape.arrival_order):  # last_arriving's order
        if (held + shape.sizes[name]) * ACCEL_SHARE_BYTES > free:
            break
        held += shape.sizes[name]
    return held / shape.n_params


def simulate(shape: Shape, m: Machine, k: float, batch: int, mode: str = "split",
             recompute: bool = False, host_bytes_per_param: float = ADAM_BYTES) -> dict:
    """One steady-state iteration. mode: 'split' (host updates overlap backward),
    'zero-offload' (all on the host, updates after backward), 'all-accelerator'.
    `host_bytes_per_param`: what the host Adam moves per parameter (28: fp32 p, g, m, v)."""
    t = times(shape, m, batch, recompute)
    host_s = m.host_s_per_byte * host_bytes_per_param
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
        cpu = s + n * host_s
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
    mem = accel_memory_bytes(shape, batch, k_act, mode, recompute)
    return {
        "mode": mode,
        "k_target": k if mode == "split" else k_act,
        "k_actual": k_act,
        "iteration_ms": period * 1e3,
        "tokens_per_s": t["tokens"] / period,
        "tflops": t["tokens"] * shape.flops_per_token() / period / 1e12,
        "hardware_tflops": t["tokens"] * shape.flops_per_token(recompute) / period / 1e12,
        "accel_idle_share": max(0.0, 1.0 - accel_busy / period),
        "host_done_before_bwd_end_share": host_done_in_bwd / host_n if host_n else float("nan"),
        "forward_ms": t_f * 1e3,
        "backward_ms": t_b * 1e3,
        "accel_memory_gib": mem / 2**30,
        "fits": mem <= m.memory_bytes,
        "events": [{"lane": l, "activity": a, "what": w, "start_ms": s * 1e3, "end_ms": e * 1e3}
                   for l, a, w, s, e in events],
    }


def best_static_k(shape: Shape, m: Machine, batch: int, points: int = 51, recompute: bool = False) -> float:
    """The k of the simulated static sweep with the highest throughput among the runs that fit the
    card; NaN where none fits."""
    ks = [i / (points - 1) for i in range(points)]
    runs = [(k, simulate(shape, m, k, batch, recompute=recompute)) for k in ks]
    fit = [(k, sim["tokens_per_s"]) for k, sim in runs if sim["fits"]]
    return max(fit, key=lambda t: t[1])[0] if fit else float("nan")


# ---------------------------------------------------------------- the seed's operating point
def _setting(name: str):
    return _profiles()["published_setting"][name]["value"]


def published_operating_point(seq_len: int | None = None, host: str | None = None, mfu: float | None = None,
                              host_meas: dict | None = None, recompute: bool | None = None) -> dict:
    """k for the seed's setting (its model, batch and GPU), from the model's own inputs only: the
    seed's alpha, k band and throughput are returned beside the modelled figures, as claims.
    k_seed_formula is the balance alone; k_on_card is what the card lets it run, the balance capped
    by the card's memory (NaN where even k = 0 does not fit); the throughput is at k_on_card."""
    claims = published_claims()
    seq = seq_len or _setting("seq_len")
    host = host or _setting("hosts")[0]
    recompute = _setting("activation_recompute")[0] if recompute is None else recompute
    host_meas = host_meas if host_meas is not None else measure_here()
    shape = model_shape(_setting("model"), seq)
    m = machine(_setting("gpu"), host, host_meas=host_meas, mfu=mfu)
    batch = claims["setup"]["batch"]
    r = rates(shape, m, batch, recompute)
    k_seed = balance_k(r, include_transfer=False)
    k_mem = k_max_for_memory(shape, batch, m.memory_bytes, recompute)
    sim = simulate(shape, m, min(k_seed, k_mem), batch, recompute=recompute)
    nan = float("nan")
    return {
        "gpu": m.gpu,
        "host": host,
        "model": shape.name,
        "n_params": shape.n_params,
        "batch": batch,
        "seq_len": seq,
        "recompute": recompute,
        "mfu": m.notes["mfu"],
        "alpha_modelled": m.alpha,
        "t_backward_s": r.t_backward_s,
        "t_update_host_s": r.t_update_host_s,
        "t_transfer_s": r.t_transfer_s,
        "host_adam_gb_per_s": ADAM_BYTES / m.host_s_per_param / GB,
        "k_seed_formula": k_seed,
        "k_with_transfer": balance_k(r, include_transfer=True),
        "k_max_memory": k_mem,
        "k_on_card": sim["k_actual"] if sim["fits"] else nan,
        "accel_memory_gib": sim["accel_memory_gib"],
        "card_memory_gib": m.memory_bytes / GIB,
        "fits": sim["fits"],
        "k_best_simulated": best_static_k(shape, m, batch, recompute=recompute),
        "tflops_modelled": sim["tflops"] if sim["fits"] else nan,
        "host_rate_from": m.notes["host update"],
        "compute_from": m.notes["forward/backward"],
        # the seed's claims: compared with, never used above
        "claim_alpha": claims["claims"]["alpha"],
        "claim_tflops": claims["claims"]["throughput_tflops"],
        "k_band": tuple(claims["claims"]["k_range"]),
    }


def measure_here() -> dict:
    """The host measurement the model's functions take (hostbench.measure_host, one thread), the one study 3
    and `split --published` both make (they had measured 8M and 16M elements, 3 and 5 times). Pass one
    measurement to every call whose figures are shown together: each call left without one measures
    anew, and this machine's rate moves between runs (a share of 0.76 and one of 1.00 seen a second apart)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # a per-core figure (see the module docstring)
    try:
        return measure_host(numel=16_000_000, backend="torch_fused", reps=5)
    finally:
        torch.set_num_threads(n)


def band_intervals(points: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    """Runs of consecutive x (sorted) whose y lies in [lo, hi], as (first x, last x)."""
    out, run = [], None
    for x, y in sorted(points):
        if lo <= y <= hi:
            run = (run[0], x) if run else (x, x)
        elif run:
            out.append(run)
            run = None
    if run:
        out.append(run)
    return out


def _k_at(seq: int, host: str, mfu: float, host_meas: dict, recompute: bool) -> dict:
    """The cheap part of the operating point at one setting: k by the seed's formula, k with
    transfers, the card's cap, and both capped (NaN where even k = 0 does not fit)."""
    shape = model_shape(_setting("model"), seq)
    m = machine(_setting("gpu"), host, host_meas=host_meas, mfu=mfu)
    batch = published_claims()["setup"]["batch"]
    r = rates(shape, m, batch, recompute)
    cap = k_max_for_memory(shape, batch, m.memory_bytes, recompute)
    fits = accel_memory_bytes(shape, batch, 0.0, "split", recompute) <= m.memory_bytes
    out = {"k_seed_formula": balance_k(r, include_transfer=False), "k_with_transfer": balance_k(r, include_transfer=True)}
    for key in list(out):  # a run at min(k, cap) holds the layers last_arriving(cap) gives at most
        capped = last_arriving(shape.arrival_order, shape.sizes, min(out[key], cap))[1]
        out[key + "_on_card"] = capped if fits else float("nan")
    return {**out, "fits": fits}


FINE_SEQ = tuple(range(16, 2049, 8))  # the verdict's sequence lengths (step 8)


def _spans(ranges: list[tuple[float, float]]) -> str:
    return "; ".join(f"seq {a}" if a == b else f"seq {a}-{b}" for a, b in ranges) or \
        f"nowhere in seq {FINE_SEQ[0]}-{FINE_SEQ[-1]}"


def _tflops_at_band(coarse: list[dict], spans: list[tuple[float, float]], lo: float, hi: float, at: tuple) -> str:
    """TFLOP/s modelled where the band holds: at the coarse grid's lengths in it; where none of them is
    (a band of seq 264-288 between 256 and 384), at the middle of its first range ('-' had read as none)."""
    shown = "; ".join(f"{op['tflops_modelled']:.0f}" for op in coarse if lo <= op["k_on_card"] <= hi)
    if shown or not spans:
        return shown or "-"
    mid = int((spans[0][0] + spans[0][1]) // 16 * 8)  # on the verdict's step-8 grid
    return f"{published_operating_point(mid, *at)['tflops_modelled']:.0f} (at seq {mid})"


def seed_verdict(host_meas: dict | None = None) -> dict:
    """For which settings (host, MFU, activation recompute, sequence length) the seed's k band
    holds, as the model computes k from its own inputs; with the seed's alpha and throughput beside
    the modelled ones. The k judged is the one the card lets the engine run: the seed's formula
    capped by what the card holds (k_seed_formula_on_card); the formula alone is shown beside it.
    Returns {"rows": the full operating point on the coarse seq grid of profiles.json, per setting;
    "verdicts": one per setting, the band's seq ranges on a step-8 grid; "text"}."""
    host_meas = host_meas if host_meas is not None else measure_here()
    claims = published_claims()["claims"]
    lo, hi = claims["k_range"]
    rows, verdicts = [], []
    for recompute in _setting("activation_recompute"):
        for host in _setting("hosts"):
            for mfu in _setting("mfu_range"):
                coarse = [published_operating_point(s, host, mfu, host_meas, recompute) for s in _setting("seq_lens")]
                rows += [{k: op[k] for k in ("host", "mfu", "recompute", "seq_len", "alpha_modelled", "k_seed_formula",
                                             "k_with_transfer", "k_max_memory", "k_on_card", "k_best_simulated",
                                             "tflops_modelled", "accel_memory_gib", "fits", "t_backward_s",
                                             "t_update_host_s")} for op in coarse]
                fine = [(s, _k_at(s, host, mfu, host_meas, recompute)) for s in FINE_SEQ]
                keys = ("k_seed_formula_on_card", "k_seed_formula", "k_with_transfer_on_card")
                spans = {key: band_intervals([(s, p[key]) for s, p in fine], lo, hi) for key in keys}
                spans["k_best_simulated"] = band_intervals([(op["seq_len"], op["k_best_simulated"]) for op in coarse],
                                                           lo, hi)
                verdicts.append({
                    "host": host, "mfu": mfu, "recompute": recompute, "alpha_modelled": coarse[0]["alpha_modelled"],
                    "fits_card": _spans(band_intervals([(s, float(p["fits"])) for s, p in fine], 1.0, 1.0)),
                    **{f"band_holds_{key}": _spans(v) for key, v in spans.items()},
                    "tflops_modelled_at_band": _tflops_at_band(coarse, spans["k_seed_formula_on_card"], lo, hi,
                                                               (host, mfu, host_meas, recompute)),
                })
    card = f"{load_profiles()[0][_setting('gpu')]['memory_gb']} GB"
    text = (f"Verdict on the seed's band k in [{lo}, {hi}] (its alpha {claims['alpha']}, {claims['throughput_tflops']} "
            "TFLOP/s): computed from inputs independent of the seed, k depends on the sequence length, the activation "
            "recompute and the host the seed does not state, and on the MFU. The k judged is the seed's formula (modelled "
            f"alpha) capped by what the {card} card holds; the band holds for "
            + "; ".join(f"{v['host']} at MFU {v['mfu']}, {'with' if v['recompute'] else 'without'} recompute: "
                        f"{v['band_holds_k_seed_formula_on_card']}" for v in verdicts)
            + ". Modelled alpha, per host: "  # each beside its host (the bare figures did not say whose)
            + ", ".join(f"{h} {a}" for h, a in dict.fromkeys((v["host"], figure_text(v["alpha_modelled"])) for v in verdicts))
            + f" against the seed's {claims['alpha']}.")
    return {"rows": rows, "verdicts": verdicts, "text": text}




# ---------------------------------------------------------------- validation against published offload systems
def validation_points() -> list[dict]:
    return _profiles()["validation"]


def validate(host_meas: dict | None = None) -> list[dict]:
    """The model against published measurements of offload systems that state their hardware:
    one row per point (source, hardware, model, setup, published, modelled, error %). No published
    figure of these points is an input of the model."""
    host_meas = host_meas if host_meas is not None else measure_here()
    rows = []
    for p in validation_points():
        m = machine(p["gpu"], p["host"], host_meas=host_meas)
        if p["kind"] == "offload_overhead":
            # added time per step: the host Adam after backward, plus any copies not overlapped
            n = p["n_params"]
            modelled = n * p["host_bytes_per_param"] * m.host_s_per_byte + n * p["link_bytes_per_param"] / 2 * (
                m.d2h_s_per_byte + m.h2d_s_per_byte)
            how = f"{n:.3g} params x {p['host_bytes_per_param']} B at the host's Adam rate ({m.notes['host update']})"
            if p["link_bytes_per_param"]:
                how += f" + {p['link_bytes_per_param']} B/param over the link"
        elif p["kind"] == "zero_offload_tflops":
            shape = model_shape(p["shape"], p["seq_len"])
            sim = simulate(shape, m, 0.0, p["batch"], mode="zero-offload", recompute=True,
                           host_bytes_per_param=ADAM_BYTES + 2)
            modelled = sim["hardware_tflops"]
            how = (f"zero-offload schedule, {shape.n_params / 1e9:.2f}B params, recomputed forward counted; "
                   f"{m.notes['forward/backward']}; host {m.notes['host update']}")
        else:
            raise ValueError(f"unknown validation kind {p['kind']!r}")
        rows.append({"source": p["source"], "hardware": p["hardware"], "model": p["model"], "setup": p["setup"],
                     "metric": p["metric"], "published": p["published"], "modelled": modelled,
                     "error_pct": 100.0 * (modelled - p["published"]) / p["published"], "how_modelled": how,
                     "id": p["id"]})
    return rows


def model_inputs(host_meas: dict | None = None, host_share: float | None = None,
                 alpha: float | None = None) -> list[dict]:
    """Every input of the model with its value and source (for the report); `host_share` and `alpha`: the
    study's what-if settings, which the modelled runs take in place of the measured host figures."""
    prof = _profiles()
    out = []
    if alpha is not None:
        out.append({"input": "alpha (t_update_accelerator / t_update_host), modelled runs", "value": f"{alpha:g}",
                    "source": "given (the alpha setting): no host rate, measured or modelled, is used for them"})
    elif host_share is not None:
        out.append({"input": "host Adam share, modelled runs", "value": f"{host_share:.2f}",
                    "source": "given (the host_share setting): the share measured here is not used for them"})
    for name, g in prof["gpus"].items():
        compute = (f"{g['bf16_dense_tflops']} TFLOP/s 16-bit dense" if g["bf16_dense_tflops"] is not None
                   else f"no compute figure: {g.get('note', 'not used')}")  # V100's is fp16: it has no bf16
        out.append({"input": f"GPU {name}", "value": f"{compute}, {g['hbm_gb_per_s']} GB/s memory, "
                    f"{g['memory_gb']} GB, {g['host_link']}", "source": g["source"]})
    for name, e in prof["mfu"].items():
        out.append({"input": f"MFU {name}", "value": e["value"], "source": e["source"]})
    for name, h in prof["hosts"].items():
        out.append({"input": f"host {name}", "value": f"{h['sockets']} x {h['cores_per_socket']} cores, "
                    f"{h['memory_gb_per_s_per_socket']} GB/s per socket", "source": h["source"]})
    for name, a in prof["assumed"].items():
        out.append({"input": name, "value": a["value"], "source": "assumed: " + a["why"]})
    if host_meas:
        out.append({"input": "per-core Adam-pattern bandwidth", "value": f"{host_meas['per_core_bytes_per_s'] / GB:.1f} GB/s",
                    "source": "measured here (one thread, hostbench.adam_pattern_bandwidth)"})
        out.append({"input": "host Adam share of the Adam-pattern probe",
                    "value": f"{min(1.0, host_meas['bandwidth_share']):.2f} (raw {host_meas.get('bandwidth_share_raw', host_meas['bandwidth_share']):.2f})",
                    "source": "measured here (one thread), clipped to 1"})
    out.append({"input": "CUDA context", "value": f"{CONTEXT_BYTES / 2**20:,.0f} MiB",
                "source": "workbench.core.memory.cuda_model.CONTEXT_BYTES (modelled, one user report; see its comment)"})
    out.append({"input": "loss logits", "value": "10 B per token per vocabulary entry",
                "source": "transformers' ForCausalLMLoss: bf16 logits, their fp32 copy (logits.float()) and "
                          "log-softmax's fp32 output, kept for backward"})
    for name in ("gpu", "model", "hosts", "seq_lens", "mfu_range", "activation_recompute"):
        e = prof["published_setting"][name]
        out.append({"input": f"seed setting: {name}", "value": e["value"], "source": "assumed: " + e["why"]})
    return out
