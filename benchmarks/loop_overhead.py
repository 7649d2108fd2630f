"""How much does the workbench's training loop cost over a bare PyTorch loop?

    python benchmarks/loop_overhead.py              # default: 3 rounds x 15 steps each way
    python benchmarks/loop_overhead.py --steps 5    # quicker

Both loops train the same model (the embedded base's architecture, random weights) on the same
batches with the same fused AdamW and gradient clipping. The workbench loop (workbench.training.
train) also samples blocks, sets the learning rate, accumulates the loss, emits one row per step
to a sink and syncs once per step; the bare loop does the minimum. The two are interleaved in
rounds (bare, workbench, bare, workbench, ...) from fresh copies of one model, so drift of this
noisy machine hits both alike (ABBA order); the first 2 steps of every run are warm-up and not counted.
Timer: time.perf_counter around whole steps (CPU: no device sync needed).

Last line: `loop_overhead: VALUE` = workbench seconds per step / bare seconds per step.
Target: at most 1.03. Version 2 (ABBA order; the bare loop's weight decay matches, 0).
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from workbench.models import EmbeddedSpec
from workbench.results import append_benchmark_row
from workbench.training import TrainSettings, train

WARMUP = 2


def build(spec: EmbeddedSpec):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
                      num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
                      num_key_value_heads=spec.num_kv_heads, tie_word_embeddings=True)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg)


def bare_loop(model, batches, lr) -> list[float]:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0, fused=True)
    model.train()
    times = []
    for x in batches:
        t0 = time.perf_counter()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        times.append(time.perf_counter() - t0)
    return times[WARMUP:]


def workbench_loop(model, blocks, settings) -> list[float]:
    rows = []
    train(model, blocks, settings, device="cpu", sinks=[rows.append])
    return [r["step_ms"] / 1e3 for r in rows][WARMUP:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=15, help="measured steps per run")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    spec = EmbeddedSpec()
    base = build(spec)
    steps = args.steps + WARMUP
    settings = TrainSettings(steps=steps, micro_batch=args.batch, lr=1e-3, schedule="constant", seed=0)
    # The exact batches the workbench loop will draw, so both loops see the same data.
    from workbench.training import BlockSampler

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, spec.vocab_size, (steps * args.batch, spec.seq_len), generator=g)
    sampler = BlockSampler(len(blocks), settings.seed)
    batches = [blocks[sampler.take(args.batch)] for _ in range(steps)]
    bare, ours = [], []
    for r in range(args.rounds):
        # ABBA order: whichever loop runs second in a round is not favoured over the rounds
        runs = [("bare", lambda: bare_loop(copy.deepcopy(base), batches, settings.lr)),
                ("ours", lambda: workbench_loop(copy.deepcopy(base), blocks, settings))]
        for name, run in (runs if r % 2 == 0 else runs[::-1]):
            (bare if name == "bare" else ours).extend(run())
        print(f"round {r + 1}: bare {sum(bare) / len(bare) * 1e3:.1f} ms/step, "
              f"workbench {sum(ours) / len(ours) * 1e3:.1f} ms/step", flush=True)
    ratio = (sum(ours) / len(ours)) / (sum(bare) / len(bare))
    print(f"torch threads {torch.get_num_threads()}, {len(bare)} measured steps each, batch {args.batch}x{spec.seq_len}")
    append_benchmark_row({"benchmark": "loop_overhead", "version": 2, "value": ratio,
                          "bare_ms_per_step": sum(bare) / len(bare) * 1e3,
                          "workbench_ms_per_step": sum(ours) / len(ours) * 1e3, "steps": len(bare)})
    print(f"loop_overhead: {ratio:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
