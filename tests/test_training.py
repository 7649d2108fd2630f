import math
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import subprocess_env, tiny_config
from transformers import AutoModelForCausalLM

from workbench.core.config import ConfigError
from workbench.core.memory import monitor
from workbench.core.training import BlockSampler, LossDiverged, TrainSettings, evaluate_perplexity, train


def model_and_blocks(seed=0):
    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(tiny_config("qwen2"))
    g = torch.Generator().manual_seed(1)
    # learnable data: a repeating pattern with noise
    base = torch.arange(16).repeat(40)[: 32 * 16].view(16, 32)
    blocks = torch.where(torch.rand(base.shape, generator=g) < 0.1, torch.randint(0, 128, base.shape, generator=g), base)
    return m, blocks


def test_rows_losses_and_determinism():
    rows = []
    m, blocks = model_and_blocks()
    r1 = train(m, blocks, TrainSettings(steps=12, micro_batch=4, lr=3e-3), sinks=[rows.append], extra={"tag": "a"})
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert {"loss", "lr", "tokens", "step_ms", "tokens_per_s", "mem_mib", "tag"} <= set(rows[0])
    assert rows[-1]["tokens"] == 12 * 4 * 32
    assert r1.losses[-1] < r1.losses[0] - 0.5  # it learns
    # each row's rate is its own step's tokens over its own time (not the run's tokens so far), and the run's
    # final loss is its last step's
    for row in rows:
        assert row["tokens_per_s"] == pytest.approx(4 * 32 / (row["step_ms"] / 1e3))
    assert r1.final_loss == r1.losses[-1] == rows[-1]["loss"] != r1.losses[0]
    m2, _ = model_and_blocks()
    r2 = train(m2, blocks, TrainSettings(steps=12, micro_batch=4, lr=3e-3))
    assert r1.losses == r2.losses  # seeded and deterministic on CPU


def test_the_run_time_is_the_steps_not_the_sinks():
    """Study 1's tokens/s divided by the whole loop's time, the sinks' included: a live chart's
    redraw (17-65 ms here as runs add up) was timed as training, most for the fastest strategies.
    Played: a sink that takes 0.1 s a row."""
    import time

    m, blocks = model_and_blocks()
    rows = []
    t0 = time.perf_counter()
    slow_sink = lambda row: time.sleep(0.1) or rows.append(row)  # noqa: E731
    r = train(m, blocks, TrainSettings(steps=3, micro_batch=4, lr=3e-3), sinks=[slow_sink])
    wall = time.perf_counter() - t0
    assert wall - r.seconds >= 0.3 and r.seconds == pytest.approx(sum(row["step_ms"] for row in rows) / 1e3)


def test_train_is_adamw_with_its_schedule_clipping_and_weight_decay():
    """train() against the loop it stands for, written out with torch's own pieces: the schedule's
    rate set on the optimizer every step, clip_grad_norm_ before the step, AdamW's weight decay.
    (Every other test trained at one rate, without clipping or decay: dropping any of the three
    passed them.)"""
    settings = TrainSettings(steps=6, micro_batch=4, lr=3e-3, warmup_steps=2, schedule="cosine",
                             weight_decay=0.1, max_grad_norm=0.05)
    m, blocks = model_and_blocks()
    result = train(m, blocks, settings)
    ref, _ = model_and_blocks()
    torch.manual_seed(settings.seed)
    opt = torch.optim.AdamW(ref.parameters(), lr=settings.lr, weight_decay=0.1, fused=True)
    sampler, norms, losses = BlockSampler(len(blocks), settings.seed), [], []
    for step in range(settings.steps):
        for g in opt.param_groups:
            g["lr"] = settings.lr_at(step)
        batch = blocks[sampler.take(4)]
        loss = ref(input_ids=batch, labels=batch).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert min(norms) > 0.05  # every step clipped
    assert len({settings.lr_at(s) for s in range(settings.steps)}) == 5  # the peak twice (warm-up's end, decay's start)
    assert result.losses == pytest.approx(losses, rel=1e-5)
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_accumulation_matches_a_big_batch():
    m1, blocks = model_and_blocks()
    m2, _ = model_and_blocks()
    a = train(m1, blocks, TrainSettings(steps=3, micro_batch=8, grad_accum=1, lr=1e-3, max_grad_norm=0))
    b = train(m2, blocks, TrainSettings(steps=3, micro_batch=2, grad_accum=4, lr=1e-3, max_grad_norm=0))
    assert a.losses == pytest.approx(b.losses, rel=1e-4)
    for p, q in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


def test_a_loss_that_is_not_a_number_stops_the_run_naming_the_step_and_the_learning_rate():
    rows = []
    m, blocks = model_and_blocks()
    with pytest.raises(LossDiverged) as e:
        train(m, blocks, TrainSettings(steps=12, micro_batch=4, lr=1e9), sinks=[rows.append])
    step = rows[-1]["step"]
    # the step's row sent, then the run stopped
    assert not math.isfinite(rows[-1]["loss"]) and all(math.isfinite(r["loss"]) for r in rows[:-1])
    assert str(e.value) == (f"the loss became {rows[-1]['loss']} at step {step} (peak learning rate 1e+09); "
                            "lower the learning rate")


def test_a_held_out_loss_past_what_a_perplexity_can_say_is_a_diverged_run_not_a_figure():
    """The evaluation after training: weights turned NaN by the last update (whose own loss was finite)
    had given a NaN perplexity stored as a finished run, and a mean loss past 709.78 nats an
    OverflowError that ended the study. Both are LossDiverged (study 1's row for a diverged run)."""
    class Fixed(torch.nn.Module):
        def __init__(self, loss):
            super().__init__()
            self.w, self.loss = torch.nn.Parameter(torch.zeros(1)), loss

        def forward(self, input_ids, labels):
            return type("Out", (), {"loss": torch.tensor(self.loss)})()

    blocks = torch.zeros((4, 8), dtype=torch.long)
    assert evaluate_perplexity(Fixed(2.0), blocks, batch_size=2) == pytest.approx(math.exp(2.0))
    assert evaluate_perplexity(Fixed(709.0), blocks, batch_size=2) == pytest.approx(math.exp(709.0))
    for loss, says in ((float("nan"), "is not a number"), (1000.0, "past any float")):
        with pytest.raises(LossDiverged, match=says):
            evaluate_perplexity(Fixed(loss), blocks, batch_size=2)


def test_tokens_a_second_leave_out_the_first_step_its_warm_up():
    """Study 1's tokens/s had counted the first step, which on a card makes the cuBLAS handles and
    loads the kernels (study 2 left it out already). Played: the first forward takes 0.4 s more."""
    import time

    m, blocks = model_and_blocks()
    forward, calls = m.forward, []

    def slow_first(*a, **k):
        calls.append(1)
        if len(calls) == 1:
            time.sleep(0.4)
        return forward(*a, **k)

    m.forward = slow_first
    rows = []
    r = train(m, blocks, TrainSettings(steps=3, micro_batch=2, lr=1e-3), sinks=[rows.append])
    assert r.first_step_seconds == pytest.approx(rows[0]["step_ms"] / 1e3) and r.first_step_seconds >= 0.4
    later = sum(row["step_ms"] for row in rows[1:]) / 1e3
    assert r.tokens_per_s == pytest.approx(2 * 2 * blocks.shape[1] / later)
    assert r.tokens_per_s > r.tokens / r.seconds  # the warm-up made the old figure lower
    one = train(m, blocks, TrainSettings(steps=1, micro_batch=2, lr=1e-3))  # one step: all there is
    assert one.tokens_per_s == pytest.approx(one.tokens / one.seconds)


def test_labels_are_shifted_once():
    m, blocks = model_and_blocks()
    m.eval()
    x = blocks[:2]
    logits = m(input_ids=x).logits
    manual = F.cross_entropy(logits[:, :-1].reshape(-1, 128), x[:, 1:].reshape(-1))
    ppl = evaluate_perplexity(m, x, batch_size=2)
    assert math.log(ppl) == pytest.approx(float(manual), rel=1e-5)


def test_checkpointing_and_bf16_run_as_asked():
    """Checkpointing runs each layer's forward again in backward, and bf16 autocast makes the
    projections' outputs bf16: counted from a layer's own calls (a loop that ignored either setting had
    passed on a finite loss, and the memory tests' predictions run this same loop)."""
    seen = {}
    for ckpt, precision in ((False, "fp32"), (True, "bf16"), (False, "bf16")):
        m, blocks = model_and_blocks()
        calls, proj = [], m.model.layers[0].mlp.gate_proj
        # the forward itself, not a forward hook (torch's recomputation in backward calls no module hooks),
        # of the MLP's first projection (it stops once what backward needs is made again: the last is not)
        proj.forward = lambda x, forward=proj.forward: calls.append((out := forward(x)).dtype) or out
        r = train(m, blocks, TrainSettings(steps=2, micro_batch=4, grad_checkpointing=ckpt, precision=precision))
        assert math.isfinite(r.final_loss)
        assert not m.is_activation_checkpointing and m.config.use_cache is True  # put back as it was
        seen[ckpt, precision] = calls
    forwards = len(seen[False, "fp32"])
    assert forwards >= 2 and len(seen[True, "bf16"]) == 2 * forwards == 2 * len(seen[False, "bf16"])
    assert set(seen[False, "fp32"]) == {torch.float32} and set(seen[True, "bf16"]) == {torch.bfloat16}


def test_bf16_on_a_card_before_ampere_says_it_is_emulated(monkeypatch):
    """A T4 (the free notebook card), a V100 or an RTX 20xx has no bf16 tensor cores, and torch
    runs bf16 there anyway, at fp32's speed or slower: a bf16 run on one said nothing."""
    cap = [(7, 5)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap[0])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    note = monitor.bf16_emulated("cuda:0")
    assert "Tesla T4 (sm_75) is emulated" in note and "fp16 with a GradScaler" in note
    assert monitor.bf16_emulated("cpu") is None
    cap[0] = (8, 0)
    assert monitor.bf16_emulated("cuda") is None
    # where it answers (a card before sm_80), the training loop warns for bf16 autocast or bf16 weights
    monkeypatch.setattr(monitor, "bf16_emulated", lambda device: "bf16 is emulated here")
    m, blocks = model_and_blocks()
    with pytest.warns(UserWarning, match="emulated here"):
        train(m, blocks, TrainSettings(steps=1, micro_batch=4, precision="bf16"))
    with pytest.warns(UserWarning, match="emulated here"):
        train(m.to(torch.bfloat16), blocks, TrainSettings(steps=1, micro_batch=4))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        train(m.float(), blocks, TrainSettings(steps=1, micro_batch=4))
    assert not [w for w in seen if "emulated" in str(w.message)]


def test_checkpointing_trains_without_transformers_use_cache_warning():
    """Each checkpointed run printed "`use_cache=True` is incompatible with gradient checkpointing.
    Setting `use_cache=False`" (transformers' own fallback); the loop now sets it, as the warning asks."""
    probe = ("import torch\nfrom conftest import tiny_config\nfrom transformers import AutoModelForCausalLM\n"
             "from workbench.core.training import TrainSettings, train\n"
             "m = AutoModelForCausalLM.from_config(tiny_config('qwen2'))\n"
             "train(m, torch.randint(0, 128, (8, 32)), TrainSettings(steps=2, micro_batch=4, grad_checkpointing=True))\n"
             "print('trained')\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).parent, env=subprocess_env(Path(__file__).parent.parent))
    assert done.returncode == 0 and done.stdout.strip() == "trained", done.stderr
    assert "use_cache" not in done.stderr


def test_schedule_and_bad_settings():
    # 10 warm-up steps climb to the peak (1/10 .. 10/10), the decay starts from it at step 10, and the
    # floor is step 100's (one past the last, as Hugging Face's schedulers count: lr_at's convention)
    s = TrainSettings(steps=100, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert s.lr_at(0) == pytest.approx(1 / 10) and s.lr_at(9) == 1.0 and s.lr_at(10) == 1.0
    assert s.lr_at(99) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 89 / 90)), abs=1e-12)
    assert s.lr_at(100) == pytest.approx(0.1, abs=1e-12)
    for bad in ({"steps": 0}, {"micro_batch": -1}, {"lr": 0.0}, {"grad_accum": 0}):
        with pytest.raises(ConfigError):
            TrainSettings.from_dict(bad)
    # each error names the value that is wrong, what it was, and the range allowed, on one line
    for bad, says in (({"warmup_steps": -1}, r"^warmup_steps must be in 0..steps \(0..100\), got -1$"),
                      ({"min_lr_ratio": 1.5}, r"min_lr_ratio .* must be in \[0, 1\], got 1.5"),
                      ({"min_lr_ratio": -0.1}, r"min_lr_ratio .* must be in \[0, 1\], got -0.1")):
        with pytest.raises(ConfigError, match=says) as e:
            TrainSettings.from_dict(bad)
        assert "\n" not in str(e.value)
    m, blocks = model_and_blocks()
    with pytest.raises(ConfigError, match="fp16"):
        train(m, blocks, TrainSettings(steps=1, precision="fp16"))


def cycle_blocks(n, seed, seq_len=32, period=16):
    """Blocks of one fixed cycle of `period` tokens, each block starting at a random point: the next
    token is certain (ppl 1), and the token after it is a different one (t+2 != t+1)."""
    cycle = torch.randperm(128, generator=torch.Generator().manual_seed(7))[:period]
    starts = torch.randint(0, period, (n, 1), generator=torch.Generator().manual_seed(seed))
    return cycle[(starts + torch.arange(seq_len)) % period]


def test_the_loop_learns_the_next_token_not_the_one_after():
    """The loop passes labels=input_ids and the model shifts them once. Shifted twice (the published
    study's labels=batch.roll(-1, dims=1)), it learns token t+2, and held-out perplexity, which
    evaluate_perplexity scores on token t+1, goes far from 1."""
    torch.manual_seed(0)
    config = tiny_config("qwen2")
    config.num_hidden_layers = 2  # learns the cycle in 60 steps (<1 s)
    m = AutoModelForCausalLM.from_config(config)
    held = cycle_blocks(16, seed=2)
    assert evaluate_perplexity(m, held) > 50  # untrained: near the vocabulary's 128
    train(m, cycle_blocks(64, seed=1), TrainSettings(steps=60, micro_batch=8, lr=1e-2))
    assert evaluate_perplexity(m, held) < 1.2


def test_perplexity_weights_tokens_not_batches():
    """3 blocks in batches of 2: the last batch holds a third of the tokens, not half of the score."""
    m, blocks = model_and_blocks()
    m.eval()
    x = torch.cat([blocks[:2], torch.randint(0, 128, (1, 32), generator=torch.Generator().manual_seed(3))])
    with torch.no_grad():
        logits = m(input_ids=x).logits
    nll = F.cross_entropy(logits[:, :-1].reshape(-1, 128), x[:, 1:].reshape(-1))  # the mean over all 3 x 31 tokens
    ppl = evaluate_perplexity(m, x, batch_size=2)
    assert math.log(ppl) == pytest.approx(float(nll), rel=1e-5)
    by_batch = (F.cross_entropy(logits[:2, :-1].reshape(-1, 128), x[:2, 1:].reshape(-1))
                + F.cross_entropy(logits[2:, :-1].reshape(-1, 128), x[2:, 1:].reshape(-1))) / 2
    assert abs(float(by_batch) - float(nll)) > 1e-3  # 20x the tolerance: the test tells the two apart


def test_perplexity_is_scored_with_dropout_off_and_the_mode_put_back():
    """GPT-2 drops out 10% in training mode: a score taken so changes from call to call. The tiny
    Qwen2 of the other tests has no dropout, so nothing failed with model.eval() taken out."""
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(tiny_config("gpt2"))
    assert m.config.resid_pdrop > 0
    x = torch.randint(0, 128, (3, 32), generator=torch.Generator().manual_seed(3))
    m.eval()
    with torch.no_grad():
        want = math.exp(float(m(input_ids=x, labels=x).loss))
    m.train()
    got = [evaluate_perplexity(m, x, batch_size=3) for _ in range(2)]
    assert got == pytest.approx([want, want], rel=1e-6) and m.training


class BlockRecorder(torch.nn.Module):
    """A model that notes which blocks each micro-batch holds (their first token is their index)."""

    def __init__(self, model):
        super().__init__()
        self.model, self.seen = model, []

    def forward(self, input_ids, labels):
        self.seen.append(input_ids[:, 0].tolist())
        return self.model(input_ids=input_ids, labels=labels)


def test_the_seed_sets_the_data_order_and_the_dropout():
    """The same seed gives the same batches and losses whatever the global RNG's state; another seed
    gives other batches, and (gpt2's dropout draws from the global RNG) other losses."""
    blocks = model_and_blocks()[1].clone()
    blocks[:, 0] = torch.arange(len(blocks))

    def run(seed, global_seed):
        torch.manual_seed(0)
        m = BlockRecorder(AutoModelForCausalLM.from_config(tiny_config("gpt2")))
        assert m.model.config.resid_pdrop > 0
        torch.manual_seed(global_seed)  # what ran before: the loop must not depend on it
        r = train(m, blocks, TrainSettings(steps=4, micro_batch=4, lr=1e-3, seed=seed))
        return r.losses, m.seen

    (losses, order), (losses_again, order_again), (losses_1, order_1) = run(0, 100), run(0, 200), run(1, 100)
    assert order == order_again and losses == losses_again
    assert order != order_1 and losses != losses_1
    assert sorted(sum(order, [])[:16]) == list(range(16))  # an epoch draws each block once


@pytest.mark.parametrize("steps,warmup", [(8, 1), (10, 0), (100, 10), (150, 7), (3, 1), (2, 0), (146, 14)])
def test_schedule_shapes(steps, warmup):
    """Warm-up climbs to the peak at step warmup - 1; the decay starts from the peak at step `warmup`,
    never rises, and spans steps - warmup steps: step `steps` (one past the last) would be the floor.
    The study's 146 steps end at 0.1001 of the peak, the tiny study's 8 at 0.145 (lr_at's docstring)."""
    for schedule in ("cosine", "linear", "constant"):
        s = TrainSettings(steps=steps, lr=2.0, warmup_steps=warmup, min_lr_ratio=0.1, schedule=schedule)
        lrs = [s.lr_at(i) for i in range(steps + 1)]  # and the step past the last
        assert lrs[:warmup] == pytest.approx([2.0 * (i + 1) / warmup for i in range(warmup)])
        assert lrs[warmup] == 2.0
        after = lrs[warmup:]
        assert all(a >= b for a, b in zip(after, after[1:]))
        if schedule == "constant":
            assert set(after) == {2.0}
            continue
        assert lrs[steps] == pytest.approx(0.2, abs=1e-12) and lrs[steps - 1] > 0.2  # the floor: one past
        assert all(a > b for a, b in zip(after, after[1:]))  # no step repeats the floor or the peak
        if schedule == "linear":
            drops = [a - b for a, b in zip(after, after[1:])]
            assert drops == pytest.approx([1.8 / (steps - warmup)] * len(drops))
        else:
            mid = (len(after) - 1) / 2  # the cosine: halfway down at the middle, symmetric about it
            if mid == int(mid):
                assert after[int(mid)] == pytest.approx(1.1)
            assert [a - 1.1 for a in after] == pytest.approx([1.1 - a for a in after[::-1]])
    if (steps, warmup) == (146, 14):  # the study's run: what the docstring says it ends at
        assert s.replace(schedule="cosine").lr_at(145) / 2.0 == pytest.approx(0.1001, abs=5e-5)
    if (steps, warmup) == (8, 1):
        assert s.replace(schedule="cosine").lr_at(7) / 2.0 == pytest.approx(0.145, abs=5e-4)


def test_warmup_up_to_steps():
    """warmup_steps = steps (a 1-step study run asks for max(1, steps // 10) = 1) climbs to the peak at
    the last step; more warm-up steps than steps is an error that names the fix (it never reached the peak)."""
    s = TrainSettings(steps=3, lr=1.0, warmup_steps=3)
    assert [s.lr_at(i) for i in range(3)] == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert TrainSettings(steps=1, lr=1.0, warmup_steps=1).lr_at(0) == 1.0
    assert TrainSettings(steps=1, lr=1.0).lr_at(0) == 1.0
    with pytest.raises(ConfigError, match=r"^warmup_steps must be in 0..steps \(0..3\), got 4: lower warmup_steps"):
        TrainSettings(steps=3, warmup_steps=4)


@pytest.mark.parametrize("fails", ["a token past the vocabulary", "a notebook cell interrupted"])
def test_a_step_that_raises_leaves_the_model_as_it_was(fails):
    """Checkpointing and use_cache are put back when a step raises, and evaluate_perplexity puts back
    the training mode: they stayed checkpointed, uncached or in eval mode for the notebook's next cell."""
    m, blocks = model_and_blocks()
    sinks = []
    if fails == "a token past the vocabulary":
        blocks = blocks.clone()
        blocks[:, 5] = 999  # the embedding's lookup raises in the step's forward
        error = IndexError
    else:
        def interrupt(row):
            raise KeyboardInterrupt
        sinks, error = [interrupt], KeyboardInterrupt
    with pytest.raises(error):
        train(m, blocks, TrainSettings(steps=3, micro_batch=4, grad_checkpointing=True), sinks=sinks)
    assert not m.is_activation_checkpointing and m.config.use_cache is True
    m.activation_checkpointing_enable()  # checkpointed already: it stays so
    train(m, model_and_blocks()[1], TrainSettings(steps=1, micro_batch=4, grad_checkpointing=True))
    assert m.is_activation_checkpointing and m.config.use_cache is True
    bad = blocks.clone()
    bad[:, 5] = 999
    for mode in (True, False):
        m.train(mode)
        with pytest.raises(IndexError):
            evaluate_perplexity(m, bad)
        assert m.training is mode
