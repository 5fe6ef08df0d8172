"""The parts of `scripts/gpu_check.py subset`: each runs in its own process under its own time limit and writes its result as
soon as it exists, so a part that fails or hangs hides nothing of the others.

    python scripts/gpu_check.py subset --out DIR [--cpu-simulation] [--parts a,b]   # the driver: every part, then the report
    python scripts/gpu_check.py part NAME --out DIR [--cpu-simulation]              # one part (what the driver runs)

The parts (`PARTS`: name, cap in seconds on one GPU, what it checks):

megatron     megatron-core in the recipe's precision (bf16, its own distributed optimizer) per recompute mode: the step
             against the fp32 torch step, the optimizer-state round trip after the step, a checkpoint before the first step
weight_sync  the weight check after a sync: the megatron policy's own log-probs against in-process engines
trainer      the in-process Trainer, 2 GRPO steps, with the torch backend and with the megatron backend in bf16 with the
             distributed optimizer: health, the first step's KL, seconds per phase, peak GPU memory
engine       the in-process engine against transformers' generate() on a GPU-sized workload (a random Qwen3-0.6B-shaped
             model in bf16, 64 requests of 1,024-2,048 prompt tokens, 256 new tokens): tokens/s, median and range of
             interleaved repeats, the workload capped at ENGINE_CAP_S by a stated rule
step4b-*     the megatron step at Qwen3-4B shapes with random weights, one process per attention path and recompute mode,
             side by side: the local spec and SDPA with full recompute at 9,216 tokens (2 rows), SDPA with selective
             recompute at 9,216 tokens where the plan says the card holds it (else 4,608), and Transformer Engine with
             full recompute where it is installed: seconds per step, tokens/s, model TFLOP/s against the bf16 matmul rate
             measured in the same process, peak GPU memory against memagent.plan, one more step taken apart at a
             synchronization (each phase's peak against the plan's phases: one above fails the part; each phase's
             seconds from CUDA events), and the split of one profiled step by part of the layer
             (memagent.bench.profile_step), reliable only where memagent.bench.split_checks finds it agrees with the
             kernels recorded, the profiled wall time, the timed step and the timed phases; a shape the plan says the
             card cannot hold is skipped and named
precision    a bf16-vs-fp32 step that can fail: the tiny model first trained in fp32 on a fixed sequence until its
             log-probs are far from uniform, then one step in each precision; a control (the untrained model) must fall
             outside the tolerance

With `--cpu-simulation` every part runs through the same code at tiny shapes on CPU (fp32 where the CPU stand-in
optimizer needs it) and step4b prints the Qwen3-4B plan it would run; the report says it is a code-path check.
"""
from __future__ import annotations
import json, math, os, statistics, subprocess, sys, time
from pathlib import Path

_HERE = Path(__file__).resolve().parent


def _sibling():
    "Make its sibling scripts/gpu_check.py importable, wherever this module was imported from."
    if str(_HERE) not in sys.path: sys.path.insert(0, str(_HERE))

ENGINE_CAP_S = 90          # the engine comparison's repeats, at most (the part's process cap adds its start-up)
REPEATS = 5                # nbs/bench.ipynb decides a goal on 5 or more repeats (memagent.bench.MIN_REPEATS)
# name, cap (s), what: the caps add up to PART_CAPS_S; a run on one H100/H200-class GPU is meant to take SUBSET_BUDGET_S
PARTS = (
    ('megatron', 60, 'megatron-core bf16 + its optimizer per recompute mode: the step against fp32 torch, the optimizer-state round trip, a checkpoint before step 1'),
    ('weight_sync', 40, 'the weight check after a sync: the megatron policy against in-process engines'),
    ('trainer', 90, 'the in-process Trainer, 2 steps, torch and megatron (bf16, distributed optimizer): health, KL, seconds per phase, peak GPU memory'),
    ('engine', 110, 'the in-process engine against generate() on a GPU-sized workload (repeats capped at 90 s)'),
    ('step4b-local-full', 60, "the megatron step at Qwen3-4B shapes, the local spec's unfused attention, full recompute, 2 rows of 4,608 tokens"),
    ('step4b-sdpa-full', 45, 'the megatron step at Qwen3-4B shapes, the SDPA core attention, full recompute, 2 rows of 4,608 tokens'),
    ('step4b-sdpa-selective', 45, 'the megatron step at Qwen3-4B shapes, the SDPA core attention, selective recompute, 2 rows of 4,608 tokens where the plan says they fit, else 1'),
    ('step4b-te-full', 45, 'the megatron step at Qwen3-4B shapes, Transformer Engine, full recompute, 2 rows of 4,608 tokens (skipped where TE is not installed)'),
    ('precision', 45, 'a bf16-vs-fp32 step on a model trained away from uniform, with a control that must fail'),
)
SUBSET_BUDGET_S = 420
CPU_CAP_FACTOR = 4         # --cpu-simulation: the same caps, times this (2 CPU cores run even tiny shapes slower than one GPU)
STEP4B = {'step4b-local-full': ('local', 'full', 2, 4608), 'step4b-sdpa-full': ('sdpa', 'full', 2, 4608),   # attention, recompute,
          'step4b-sdpa-selective': ('sdpa', 'selective', 2, 4608), 'step4b-te-full': ('te', 'full', 2, 4608)}  # rows (at most), tokens per row
STEP4B_HEADROOM = 0.95     # a step4b shape runs when the plan's update peak is within this share of the card: the allocator's
                           # fragmentation and the libraries' workspaces are not terms of the plan
STEP4B_GOAL = {'sdpa_over_local_model_tflops': 2.0, 'fraction_of_matmul_rate': 0.40}   # the fused path's goal and aim (full recompute)
TOL = {'loss_rel': 2e-2, 'grad_norm_rel': 5e-2}
CPU_TOKENS = 256           # --cpu-simulation: the tokens of a step's rows (a GPU runs the preset's micro-batch budget)


def _gc():
    import gc, torch
    gc.collect()
    if torch.cuda.is_available(): torch.cuda.empty_cache()


def _sync():
    import torch
    if torch.cuda.is_available(): torch.cuda.synchronize()


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def _peak_reset():
    import torch
    if torch.cuda.is_available(): torch.cuda.reset_peak_memory_stats()


def _peak():
    import torch
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None


class Recorder:
    "One part's result file (`parts/NAME.json`), rewritten after every measurement so what exists survives a later hang."
    def __init__(self, out: Path, name: str):
        self.path, self.body = out / 'parts' / f'{name}.json', {'part': name, 'status': 'running', 'results': {}}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.t0 = time.perf_counter()
        self.write()

    def put(self, key: str, value):
        self.body['results'][key] = value
        print(f"[{self.body['part']}] {key}: {json.dumps(value, default=str)[:600]}", flush=True)
        self.write()

    def write(self):
        self.body['seconds'] = time.perf_counter() - self.t0
        tmp = self.path.with_suffix('.tmp')
        tmp.write_text(json.dumps(self.body, indent=1, default=str)); tmp.replace(self.path)

    def done(self, passed: bool):
        self.body.update(status='ok', passed=bool(passed)); self.write()


# ---- the parts -------------------------------------------------------------------------------------------------

def part_megatron(rec: Recorder, cpu_sim: bool):
    "Per recompute mode: one megatron step in the recipe's precision against the fp32 torch step on the same rows; state round trip."
    import torch
    _sibling(); from gpu_check import tiny_megatron, _fixed_batch, _step, checkpoint_before_first_step
    from memagent.models import load_model
    from memagent.backends.torch import TorchBackend
    from memagent.backends.megatron import MegatronBackend
    from memagent.ondevice import compute_device
    dev, dtype = compute_device(), ('float32' if cpu_sim else 'bfloat16')
    base = tiny_megatron('selective', dtype)
    batch = _fixed_batch(load_model('tiny-qwen3', 'float32').config.vocab_size, CPU_TOKENS if cpu_sim else base.batch.max_tokens_per_micro)
    ref = TorchBackend(load_model('tiny-qwen3', 'float32', dev), base.optim, base.optim.grad_clip)
    ref_loss, ref_norm = _step(ref, batch)
    ref_w = {k: v.float().cpu() for k, v in ref.hf_state_dict().items()}
    del ref; _gc()
    ok = True
    for mode in ('none', 'selective', 'full'):
        cfg = tiny_megatron(mode, dtype)
        be = MegatronBackend.from_config(cfg, load_model('tiny-qwen3', dtype))
        try:
            before = checkpoint_before_first_step(be)
            loss, norm = _step(be, batch)
            w = {k: v.float().cpu() for k, v in be.hf_state_dict().items()}
            state = be.state_dict()
            be.load_state_dict(be.hf_state_dict(), state)
            same = json.dumps(state, default=str, sort_keys=True) == json.dumps(be.state_dict(), default=str, sort_keys=True)
            r = {'recompute': mode, 'dtype': dtype, 'optimizer': type(be.optimizer).__name__, 'attention': be.attention,
                 'parameter_dtypes': sorted({str(p.dtype) for p in be.model.parameters()}),
                 'loss': loss, 'loss_fp32': ref_loss, 'loss_rel_diff': abs(loss - ref_loss) / abs(ref_loss), 'grad_norm': norm,
                 'grad_norm_fp32': ref_norm, 'grad_norm_rel_diff': abs(norm - ref_norm) / ref_norm,
                 'weights_max_abs_diff': max(float((w[k] - ref_w[k]).abs().max()) for k in ref_w),
                 'checkpoint_before_first_step': before, 'optimizer_state_round_trip': same}
        finally: be.close(); del be; _gc()
        r['pass'] = (r['loss_rel_diff'] < TOL['loss_rel'] and r['grad_norm_rel_diff'] < TOL['grad_norm_rel'] and same and before['pass']
                     and r['parameter_dtypes'] == [f'torch.{dtype}'])
        ok &= r['pass']
        rec.put(mode, r)
    rec.done(ok)


def part_weight_sync(rec: Recorder, cpu_sim: bool):
    _sibling(); from gpu_check import weight_sync_check
    from memagent.ondevice import compute_device
    r = weight_sync_check(str(compute_device()), 'float32' if cpu_sim else 'bfloat16', CPU_TOKENS if cpu_sim else None)
    rec.put('weight_sync', r)
    rec.done(r['pass'])


def _register_reward():
    from memagent.reward import REWARDS, register_reward
    if 'gpu_check_odd_length' not in REWARDS:
        register_reward('gpu_check_odd_length')(lambda text, answers: float(len(text) % 2))


def part_trainer(rec: Recorder, cpu_sim: bool):
    "The in-process Trainer, 2 steps per backend, as a user with one GPU runs it."
    import shutil
    from memagent.config import get_preset
    from memagent.data import make_synthetic
    from memagent.trainer import Trainer
    _register_reward()
    ex = make_synthetic(4, num_words=40, hops=1, seed=0)
    base = {'grpo.reward': 'gpu_check_odd_length', 'grpo.group_size': 4, 'schedule.steps': 2, 'schedule.save_every': 2}
    layouts = {'torch': {'backend': 'torch'},
               'megatron': {'backend': 'megatron', 'batch.recompute': 'selective',
                            **({'model.dtype': 'float32', 'batch.distributed_optimizer': False} if cpu_sim else
                               {'model.dtype': 'bfloat16', 'batch.distributed_optimizer': True})}}
    ok = True
    for name, ov in layouts.items():
        run = Path(rec.path.parent) / 'runs' / f'trainer-{name}'
        shutil.rmtree(run, ignore_errors=True)
        t0 = time.perf_counter(); _peak_reset()
        tr = Trainer(get_preset('tiny', {**base, **ov}), run, ex, progress=False, tensorboard=False)
        setup = time.perf_counter() - t0
        try:
            ms = tr.train()
            dev = str(tr.group.policy.device)
        finally: tr.close(); del tr; _gc()
        health = json.loads((run / 'health.json').read_text())
        r = {'backend': name, 'overrides': ov, 'device': dev, 'health': health.get('status'), 'setup_s': setup,
             'kl_step1': ms[0].get('kl'), 'steps': [{k: m.get(k) for k in ('step', 'reward_mean', 'loss', 'grad_norm', 'kl', 'rows_consumed',
                                                                          'gpu_peak_gib', 'time_rollout', 'time_update', 'time_sync', 'time_step')}
                                                  for m in ms],
             'gpu_peak_gib': max((m.get('gpu_peak_gib') or 0 for m in ms), default=None) if _cuda() else None}
        kl_tol = 0.0 if cpu_sim else 1e-6
        r['pass'] = (r['health'] == 'completed' and len(ms) == 2 and all(math.isfinite(m['loss']) for m in ms)
                     and isinstance(r['kl_step1'], float) and abs(r['kl_step1']) <= kl_tol)
        ok &= r['pass']
        rec.put(name, r)
    rec.done(ok)


def _random_model(arch, dtype: str, device, seed: int = 0):
    "A random HF Qwen3 model of `arch`'s shape (memagent.plan.ARCHS), built on `device` in `dtype`."
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config
    c = Qwen3Config(hidden_size=arch.hidden, num_hidden_layers=arch.layers, num_attention_heads=arch.heads,
                    num_key_value_heads=arch.kv_heads, head_dim=arch.head_dim, intermediate_size=arch.ffn, vocab_size=arch.vocab,
                    tie_word_embeddings=arch.tied, max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6)
    torch.manual_seed(seed)
    with torch.device(device): m = AutoModelForCausalLM.from_config(c, dtype=getattr(torch, dtype))
    return m.eval()


def engine_workload(cpu_sim: bool) -> dict:
    "The comparison's workload: on a GPU the one the first H200 run tried; on CPU a tiny one through the same code."
    if cpu_sim: return dict(model='tiny-qwen3', dtype='float32', requests=8, min_tokens=48, max_tokens=96, new_tokens=8)
    return dict(model='Qwen/Qwen3-0.6B (shape, random weights)', dtype='bfloat16', requests=64, min_tokens=1024, max_tokens=2048,
                new_tokens=256)


def shrink(w: dict, predicted_s: float, budget_s: float) -> tuple[dict, list[str]]:
    "The stated rule: while a repeat is predicted to overrun its share of the budget, halve the requests (down to 8), then the new tokens (down to 32)."
    w, steps = dict(w), []
    while predicted_s > budget_s and (w['requests'] > 8 or w['new_tokens'] > 32):
        k = 'requests' if w['requests'] > 8 else 'new_tokens'
        w[k] //= 2; predicted_s /= 2; steps.append(f"{k} halved to {w[k]}")
    return w, steps


def part_engine(rec: Recorder, cpu_sim: bool):
    "HFEngine against generate() on the same prompts, interleaved repeats; the workload shrunk by `shrink` if a probe predicts an overrun."
    from memagent.bench import bench_generate, bench_prompts, spread, verdict
    from memagent.engines import HFEngine
    from memagent.models import load_model, load_tokenizer
    from memagent.ondevice import compute_device
    from memagent.plan import ARCHS
    dev = compute_device()
    w0 = engine_workload(cpu_sim)
    tok = load_tokenizer('tiny-qwen3' if cpu_sim else 'qwen3')
    model = load_model('tiny-qwen3', 'float32', dev) if cpu_sim else _random_model(ARCHS['Qwen/Qwen3-0.6B'], w0['dtype'], dev)
    eng = HFEngine(model, tok)
    # the probe: one small repeat of each side predicts a full repeat's seconds (time ~ requests x new tokens)
    probe = dict(w0, requests=min(8, w0['requests']), new_tokens=min(32, w0['new_tokens']))
    prompts = bench_prompts(tok, probe['requests'], probe['max_tokens'], probe['min_tokens'])
    t0 = time.perf_counter(); bench_generate(eng, prompts, probe['new_tokens']); probe_s = time.perf_counter() - t0
    scale = (w0['requests'] / probe['requests']) * (w0['new_tokens'] / probe['new_tokens'])
    w, shrunk = shrink(w0, probe_s * scale, ENGINE_CAP_S / REPEATS)
    rec.put('workload', {'asked': w0, 'run': w, 'probe_s': probe_s, 'predicted_repeat_s': probe_s * scale, 'shrunk': shrunk,
                         'rule': f"a repeat (engine + generate()) may take {ENGINE_CAP_S}/{REPEATS} s: while the probe predicts more, "
                                 "halve the requests (to 8), then the new tokens (to 32)"})
    prompts = bench_prompts(tok, w['requests'], w['max_tokens'], w['min_tokens'])
    reps, t_start, stopped = [], time.perf_counter(), None
    for i in range(REPEATS):
        if reps and time.perf_counter() - t_start + (time.perf_counter() - t_start) / len(reps) > ENGINE_CAP_S:
            stopped = f"stopped after {len(reps)} repeats: the next would pass the {ENGINE_CAP_S} s cap"; break
        r = bench_generate(eng, prompts, w['new_tokens'], seed=i)
        reps.append({'engine_tokens_per_s': r['engine']['tokens_per_s'], 'generate_tokens_per_s': r['generate']['tokens_per_s'],
                     'ratio': r['ratio'], 'engine_s': r['engine']['wall_s'], 'generate_s': r['generate']['wall_s']})
        rec.put(f'repeat_{i + 1}', reps[-1])
    ratios = [x['ratio'] for x in reps]
    res = {'repeats': len(reps), 'stopped': stopped, 'ratio': spread(ratios), 'goal': 'engine tokens/s >= generate() tokens/s',
           'verdict': verdict(ratios, '>=', 1.0), 'engine_tokens_per_s': spread([x['engine_tokens_per_s'] for x in reps]),
           'generate_tokens_per_s': spread([x['generate_tokens_per_s'] for x in reps]), 'device': str(dev)}
    rec.put('summary', res)
    rec.done(len(reps) >= 1)


def matmul_rate(dtype: str, n: int = 8192, repeats: int = 5) -> float:
    "FLOP/s of an n x n matmul in `dtype` on this process's device (the best of `repeats`, synchronized, after a warm-up)."
    import torch
    from memagent.ondevice import compute_device
    dev = compute_device()
    a = torch.randn(n, n, device=dev, dtype=getattr(torch, dtype)); b = torch.randn(n, n, device=dev, dtype=getattr(torch, dtype))
    a @ b; _sync(); ts = []
    for _ in range(repeats):
        t0 = time.perf_counter(); a @ b; _sync(); ts.append(time.perf_counter() - t0)
    return 2 * n ** 3 / min(ts)


def model_flops(arch, tokens: int, seq_len: int, head_positions: int | None = None) -> float:
    "Model FLOPs of one training step (forward + backward, recompute not counted): 6 N T for the N parameters outside the output head, 6 V h H for the head on the H positions the log-prob head computes (the response positions; all T if not given), plus causal attention, 6 T L (heads x head_dim) per layer."
    head = arch.vocab * arch.hidden                    # the output head's matrix (tied: the embedding's, counted once in numel)
    H = tokens if head_positions is None else head_positions
    return 6 * (arch.numel() - head) * tokens + 6 * head * H + 6 * tokens * seq_len * arch.heads * arch.head_dim * arch.layers


def response_positions(rows: int, seq_len: int) -> int:
    "The positions the log-prob head computes in a step4b batch: the response half of each row (`step4b_batch`), whose first token is never position 0."
    return rows * (seq_len - seq_len // 2)


def step4b_batch(rows: int, seq_len: int, vocab: int, device) -> dict:
    "The step4b parts' fixed batch: seeded random tokens, the second half of each row the response."
    import torch
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, vocab, (rows, seq_len), generator=g)
    resp = torch.zeros_like(ids, dtype=torch.bool); resp[:, seq_len // 2:] = True
    return {'input_ids': ids.to(device), 'attention_mask': torch.ones_like(ids, dtype=torch.bool).to(device), 'response_mask': resp.to(device)}


def step4b_config(recompute: str, cpu_sim: bool, attention: str = 'auto'):
    "The frozen recipe's step on one GPU: TP 1, no sequence parallel, its distributed optimizer (CPU: the stand-in, fp32), `batch.attention`."
    from memagent.config import get_preset
    ov = {'batch.n_gpus': 1, 'batch.tp': 1, 'batch.sequence_parallel': False, 'batch.recompute': recompute, 'rollout.colocate': False,
          'rollout.gpus_per_engine': 1, 'loss.kl_type': 'none', 'batch.attention': attention}
    if cpu_sim: ov.update({'model.name': 'tiny-qwen3', 'model.tokenizer': 'tiny-qwen3', 'model.dtype': 'float32', 'batch.distributed_optimizer': False})
    return get_preset('qwen3-4b-frozen', ov)


def step4b_plan(recompute: str, rows: int, seq_len: int, gpu_gib: float, cpu_sim: bool = False, attention: str = 'auto'):
    "memagent.plan at the part's shape on this card (its Transformer Engine as installed; 'te' is planned as if it were): the config and the plan."
    from memagent.backends.megatron import have_transformer_engine
    from memagent.plan import Cluster, make_plan
    cfg = step4b_config(recompute, cpu_sim, attention)
    te = attention == 'te' or (have_transformer_engine() and not cpu_sim)
    p = make_plan(cfg, Cluster(1, gpu_gib, transformer_engine=te), search=False, micro_batch=(rows, seq_len))
    return cfg, p


PHASES = ('forward', 'backward (with recompute)', 'optimizer step')

def _phase_step(be, batch) -> tuple[dict | None, dict]:
    "One step taken apart per phase: the seconds of the forward, the backward with its recompute and the optimizer step (CUDA events on a GPU, the host clock on CPU), and on a GPU the allocator's peak (GiB: held before it, the forward and backward's peak, held after the backward, the optimizer step's peak)."
    import torch
    from memagent.plan import GiB
    cuda = _cuda()
    if cuda:
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); held = torch.cuda.memory_allocated()
        mark = lambda i: marks[i].record()
    else:
        marks = [0.0] * 4
        def mark(i): marks[i] = time.perf_counter()
    mark(0)
    lp = be.logprobs(batch); loss = -(lp.sum() / batch['response_mask'][:, 1:].sum())
    mark(1)
    be.backward(loss); del lp, loss
    mark(2)
    if cuda:
        torch.cuda.synchronize(); backward, after = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    be.step()
    mark(3)
    if cuda:
        torch.cuda.synchronize()
        secs = [marks[i].elapsed_time(marks[i + 1]) / 1e3 for i in range(3)]
        mem = {'held before the step': held / GiB, 'backward': backward / GiB, 'held after the backward': after / GiB,
               'optimizer step': torch.cuda.max_memory_allocated() / GiB}
    else: secs, mem = [marks[i + 1] - marks[i] for i in range(3)], None
    return mem, dict(zip(PHASES, secs))


def memory_by_phase(phases_gib: dict | None, plan_phases_gib: dict | None) -> dict:
    "Every phase's measured peak against its planned phase (GiB): a phase above its plan is a failed memory check."
    ph, pp = phases_gib or {}, plan_phases_gib or {}
    return {k: {'peak_gib': ph[k], 'plan_gib': pp[k], 'over': ph[k] > pp[k]} for k in pp if k in ph}


def part_step4b(rec: Recorder, name: str, cpu_sim: bool):
    "One attention path and recompute mode of the megatron step at Qwen3-4B shapes (CPU: the tiny model at small shapes), sized by the plan to the card, then one profiled step split by part of the layer."
    import torch
    from memagent.backends.megatron import MegatronBackend, have_transformer_engine
    from memagent.bench import profile_step, split_checks
    from memagent.ondevice import compute_device
    from memagent.plan import GiB, get_arch
    _sibling(); from gpu_check import _step
    attention, recompute, most_rows, seq_len = STEP4B[name]
    if attention == 'te' and not (have_transformer_engine() and _cuda() and not cpu_sim):
        rec.put('skipped', 'Transformer Engine is not installed here' if not have_transformer_engine() else 'Transformer Engine needs a GPU')
        rec.done(True); return
    gpu_gib = torch.cuda.get_device_properties(0).total_memory / GiB if _cuda() else 139.8
    tried = []
    for rows in range(most_rows, 0, -1):                       # the most rows the plan says this card holds
        _, p4b = step4b_plan(recompute, rows, seq_len, gpu_gib, attention=attention)
        plan4b = {'rows': rows, 'seq_len': seq_len, 'gpu_gib': gpu_gib, 'attention': p4b.details['attention'],
                  'update_allocated_gib': p4b.allocated('update') / GiB, 'update_peak_gib': p4b.peak('update') / GiB,
                  'headroom': STEP4B_HEADROOM, 'fits': p4b.peak('update') <= STEP4B_HEADROOM * gpu_gib * GiB,
                  'terms_gib': {k: v / GiB for k, v in p4b.update.items()}}
        tried.append(plan4b)
        if plan4b['fits']: break
    rec.put('plan_qwen3_4b', plan4b)
    if len(tried) > 1:
        rec.put('rows_reduced', f"{most_rows} rows of {seq_len} tokens: the plan's update peak ({tried[0]['update_peak_gib']:.1f} GiB) is over "
                                f"{STEP4B_HEADROOM:.0%} of this {gpu_gib:.1f} GiB card; ran {plan4b['rows']}" if plan4b['fits'] else 'no row count fits')
    rows = plan4b['rows']
    if cpu_sim: seq_len = 128                                  # the same code at a tiny shape
    elif not plan4b['fits']:
        rec.put('skipped', f"the plan's update peak ({plan4b['update_peak_gib']:.1f} GiB for one row) is over {STEP4B_HEADROOM:.0%} of this {gpu_gib:.1f} GiB card")
        rec.done(True); return
    cfg, p = step4b_plan(recompute, rows, seq_len, gpu_gib, cpu_sim, attention)
    arch = get_arch(cfg.model.name)
    dev = compute_device()
    mm_n = 8192 if _cuda() else 1024
    rates = [matmul_rate(cfg.model.dtype, mm_n)]             # measured again after the timed steps: the higher one is the ceiling
    t0 = time.perf_counter()
    from memagent.models import load_model
    hf = load_model('tiny-qwen3') if cpu_sim else _random_model(arch, cfg.model.dtype, dev)
    be = MegatronBackend.from_config(cfg, hf)
    del hf; _gc()
    build_s = time.perf_counter() - t0
    batch = step4b_batch(rows, seq_len, arch.vocab, dev)
    head_positions = int(batch['response_mask'][:, 1:].sum())
    _peak_reset()
    secs = []
    try:
        for i in range(4):                                      # one warm-up, three timed
            _sync(); t = time.perf_counter(); loss, norm = _step(be, batch); _sync()
            if i: secs.append(time.perf_counter() - t)
        peak = _peak()
        rates.append(matmul_rate(cfg.model.dtype, mm_n))      # (a slow spell of a shared host during one measurement lowers it)
        rate = max(rates)
        rec.put('matmul_rate_tflops', {'before': rates[0] / 1e12, 'after': rates[1] / 1e12, 'used': rate / 1e12})
        built = be.attention
        phases, phase_s = _phase_step(be, batch)               # one more step, taken apart per phase
        split = profile_step(be.model, lambda: _step(be, batch))   # after the peak: the profiler's buffers are not the step's
    finally: be.close(); del be; _gc()
    tokens = rows * seq_len
    med = statistics.median(secs)
    split['checks'] = split_checks(split, phase_s, med)
    flops = model_flops(arch, tokens, seq_len, head_positions)
    planned = p.allocated('update')
    r = {'recompute': recompute, 'rows': rows, 'seq_len': seq_len, 'tokens': tokens, 'attention': built, 'planned_attention': p.details['attention'],
         'dtype': cfg.model.dtype, 'distributed_optimizer': cfg.batch.distributed_optimizer, 'build_s': build_s,
         'seconds_per_step': {'median': med, 'min': min(secs), 'max': max(secs), 'n': len(secs)}, 'tokens_per_s': tokens / med,
         'model_tflops': flops / med / 1e12, 'model_tflops_range': [flops / max(secs) / 1e12, flops / min(secs) / 1e12],
         'head_positions': head_positions, 'matmul_tflops': rate / 1e12, 'fraction_of_matmul_rate': flops / med / rate,
         'loss': loss, 'grad_norm': norm, 'peak_gib': peak / GiB if peak is not None else None, 'plan_gib': planned / GiB,
         'peak_over_plan': peak / planned if peak is not None else None,
         'plan_terms_gib': {k: v / GiB for k, v in p.update.items()}, 'split': split, 'phases_gib': phases, 'phases_s': phase_s,
         'plan_phases_gib': {k: v / GiB for k, v in p.details['update_phases'].items()}}
    r['memory_by_phase'] = memory_by_phase(phases, r['plan_phases_gib'])
    r['pass'] = (math.isfinite(loss) and math.isfinite(norm) and (peak is None or peak <= planned)
                 and not any(m['over'] for m in r['memory_by_phase'].values()) and built == attention == r['planned_attention'])
    rec.put('step', r)
    rec.done(r['pass'])


def step4b_side_by_side(parts: dict) -> dict | None:
    "The step4b parts that ran, side by side, and the fused path's goal: SDPA's model TFLOP/s over the local spec's (full recompute), its range from the repeats' extremes, and the fraction of the matmul rate."
    steps = {n: parts[n]['results']['step'] for n in STEP4B if n in parts and 'step' in parts[n].get('results', {})}
    if not steps: return None
    rows = [{'part': n, **{k: s[k] for k in ('attention', 'recompute', 'rows', 'seq_len', 'tokens_per_s', 'model_tflops', 'fraction_of_matmul_rate',
                                           'peak_gib', 'plan_gib')}, 'seconds_per_step': s['seconds_per_step']['median'],
              'split': s['split']['share'], 'split_reliable': s['split_checks']['reliable'],
              'memory_over_plan': [k for k, m in s.get('memory_by_phase', {}).items() if m['over']]} for n, s in steps.items()]
    out = {'rows': rows}
    lo, sd = steps.get('step4b-local-full'), steps.get('step4b-sdpa-full')
    if lo and sd and (lo['rows'], lo['seq_len']) == (sd['rows'], sd['seq_len']):
        ratio = sd['model_tflops'] / lo['model_tflops']
        worst, best = sd['model_tflops_range'][0] / lo['model_tflops_range'][1], sd['model_tflops_range'][1] / lo['model_tflops_range'][0]
        g = STEP4B_GOAL['sdpa_over_local_model_tflops']
        out['sdpa_over_local'] = {'median': ratio, 'min': worst, 'max': best, 'goal': f'>= {g:g}',
                                  'verdict': 'met' if worst >= g else 'not met' if best < g else 'undecided'}
        f = sd['fraction_of_matmul_rate']
        out['sdpa_fraction_of_matmul_rate'] = {'value': f, 'aim': STEP4B_GOAL['fraction_of_matmul_rate'],
                                               'reached': f >= STEP4B_GOAL['fraction_of_matmul_rate']}
        chk = sd['split_checks']
        top = max((k for k in sd['split']['share'] if k != 'other'), key=lambda k: sd['split']['share'][k]) if chk['reliable'] else None
        out['sdpa_largest_part'] = {'part': top, 'share': sd['split']['share'][top] if top else None, 'reliable': chk['reliable'],
                                    'verdict': split_verdict(chk)}
    return out


def part_precision(rec: Recorder, cpu_sim: bool):
    "bf16 against fp32 on a model whose log-probs are far from uniform; the untrained model must fail the same tolerance."
    import torch
    _sibling(); from gpu_check import tiny_megatron, _fixed_batch, _step
    from memagent.models import load_model
    from memagent.backends.torch import TorchBackend
    from memagent.backends.megatron import MegatronBackend
    from memagent.ondevice import compute_device
    dev = compute_device()
    cfg32 = tiny_megatron('selective', 'float32')
    hf = load_model('tiny-qwen3', 'float32', dev)
    V = hf.config.vocab_size
    batch = {k: v.to(dev) for k, v in _fixed_batch(V, CPU_TOKENS // 2 if cpu_sim else 512).items()}
    untrained = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    from memagent.config import OptimCfg
    trainer = TorchBackend(hf, OptimCfg(name='adam', lr=1e-2), grad_clip=1.0)
    n = int(batch['response_mask'][:, 1:].sum())
    for _ in range(40):                                        # a fixed sequence, learned: log-probs far from uniform
        lp = trainer.logprobs(batch); loss = -(lp.sum() / n); trainer.backward(loss); trainer.step()
    with torch.no_grad(): trained_loss = float(-(trainer.logprobs(batch).sum() / n))
    rec.put('training', {'uniform_loss_ln_vocab': math.log(V), 'trained_loss': trained_loss, 'steps': 40})
    trained = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    del trainer

    def fp32_step(sd):
        m = load_model('tiny-qwen3', 'float32', dev); m.load_state_dict(sd)
        be = TorchBackend(m, cfg32.optim, cfg32.optim.grad_clip)
        out = _step(be, batch); del be, m; _gc(); return out

    def bf16_step(sd):
        "One megatron step in bf16 (fp32 main params; the distributed optimizer on a GPU, the CPU stand-in on CPU)."
        cfg = tiny_megatron('selective', 'bfloat16', distributed_optimizer=_cuda())
        m = load_model('tiny-qwen3', 'float32'); m.load_state_dict({k: v.cpu() for k, v in sd.items()})
        be = MegatronBackend.from_config(cfg, m.to(torch.bfloat16))
        try: return _step(be, batch)
        finally: be.close(); del be; _gc()

    l32, n32 = fp32_step(trained)
    l16, n16 = bf16_step(trained)
    rel = lambda a, b: abs(a - b) / abs(b)
    check = {'loss_fp32': l32, 'loss_bf16': l16, 'loss_rel_diff': rel(l16, l32), 'grad_norm_fp32': n32, 'grad_norm_bf16': n16,
             'grad_norm_rel_diff': rel(n16, n32)}
    check['pass'] = check['loss_rel_diff'] < TOL['loss_rel'] and check['grad_norm_rel_diff'] < TOL['grad_norm_rel']
    rec.put('bf16_vs_fp32', check)
    lu, nu = bf16_step(untrained)                              # the control: another model, same tolerance
    control = {'loss_bf16_untrained': lu, 'loss_rel_diff': rel(lu, l32), 'grad_norm_rel_diff': rel(nu, n32)}
    control['outside_tolerance'] = control['loss_rel_diff'] >= TOL['loss_rel'] or control['grad_norm_rel_diff'] >= TOL['grad_norm_rel']
    rec.put('control_untrained', control)
    far = trained_loss < 0.5 * math.log(V)
    rec.done(check['pass'] and control['outside_tolerance'] and far)


def run_part(name: str, out: Path, cpu_sim: bool):
    "One part in this process: its result file under `out/parts/`; an exception is recorded there before it propagates."
    rec = Recorder(out, name)
    fn = {'megatron': part_megatron, 'weight_sync': part_weight_sync, 'trainer': part_trainer, 'engine': part_engine,
          'precision': part_precision}.get(name)
    try:
        if name in STEP4B: part_step4b(rec, name, cpu_sim)
        elif fn is None: raise SystemExit(f"gpu_check.py part: unknown part {name!r}; the parts: {[p for p, _, _ in PARTS]}")
        else: fn(rec, cpu_sim)
    except BaseException as e:
        import traceback
        rec.body.update(status='error', passed=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-4000:])
        rec.write(); raise


# ---- the driver -------------------------------------------------------------------------------------------------

def run_subset(out: Path, cpu_sim: bool, parts: list[str] | None, py: str = sys.executable) -> dict:
    "Every part in its own process under its cap, in order; after each, the report is rendered again from the part files."
    names = [p for p, _, _ in PARTS]
    todo = names if not parts else parts
    bad = [p for p in todo if p not in names]
    if bad: raise SystemExit(f"gpu_check.py subset: unknown part(s) {bad}; the parts: {names}")
    status, t_all, fixed = {}, time.perf_counter(), report_header(cpu_sim)
    body = None
    for name, cap, _ in PARTS:
        if name not in todo: continue
        cmd = [py, str(_HERE / 'gpu_check.py'), 'part', name, '--out', str(out)] + (['--cpu-simulation'] if cpu_sim else [])
        cap = cap * (CPU_CAP_FACTOR if cpu_sim else 1)
        print(f"== part {name} (cap {cap} s): {' '.join(cmd)}", flush=True)
        t = time.perf_counter()
        try:
            p = subprocess.run(cmd, timeout=cap, env={**os.environ, 'PYTHONUNBUFFERED': '1'})
            status[name] = {'rc': p.returncode, 'timed_out': False}
        except subprocess.TimeoutExpired:
            status[name] = {'rc': None, 'timed_out': True}
            print(f"== part {name}: stopped at its cap of {cap} s", flush=True)
        status[name].update(seconds=time.perf_counter() - t, cap_s=cap)
        body = write_report(out, fixed, status, time.perf_counter() - t_all)   # after every part: what exists is reported
    return body


def part_view(out: Path, name: str, st: dict | None) -> dict:
    "A part's file, with how its process ended: 'passed', 'skipped' (named, e.g. a shape the plan says this card cannot hold), 'failed', 'error', 'timeout' (what it wrote before), 'not run'."
    f = out / 'parts' / f'{name}.json'
    body = json.loads(f.read_text()) if f.is_file() else {'part': name, 'results': {}}
    if st is None: body['verdict'] = 'not run'
    elif st['timed_out']: body['verdict'] = 'timeout'
    elif body.get('status') == 'ok':
        body['verdict'] = ('failed' if not (body.get('passed') and st['rc'] == 0) else
                           'skipped' if 'skipped' in body.get('results', {}) else 'passed')
    else: body['verdict'] = 'error'
    body['process'] = st
    return body


def report_header(cpu_sim: bool) -> dict:
    "What the report says before any part runs, read once: the layout (the doctor's rows), the environment, the device."
    _sibling(); from gpu_check import subset_layout, environment
    from memagent.backends.megatron import have_transformer_engine
    import torch
    _, layout = subset_layout(cpu_sim)
    return {'layout': layout, 'cpu_simulation': cpu_sim, 'environment': environment(), 'transformer_engine': have_transformer_engine(),
            'device': torch.cuda.get_device_name(0) if torch.cuda.is_available() and not cpu_sim else 'cpu'}


REDERIVED_WHY = ("model_flops counts the tied log-prob head on the positions it computes (the response positions), not on every "
                 "token; model TFLOP/s and the fraction of the matmul rate re-derived from the recorded seconds")

def derive_step4b(view: dict, cpu_sim: bool) -> None:
    "What a step4b part's report reads, derived from its recorded figures by the code of now: model FLOPs on the positions computed (the recorded values kept beside the new ones where they differ), every phase's peak against its plan (one above fails the part), the split's checks."
    from memagent.bench import split_checks
    from memagent.plan import get_arch
    s = view.get('results', {}).get('step')
    if not s: return
    arch = get_arch(step4b_config(s['recompute'], cpu_sim).model.name)
    s.setdefault('head_positions', response_positions(s['rows'], s['seq_len']))      # the batch rule of every step4b run
    sec, flops = s['seconds_per_step'], model_flops(arch, s['tokens'], s['seq_len'], s['head_positions'])
    now = {'model_tflops': flops / sec['median'] / 1e12, 'model_tflops_range': [flops / sec['max'] / 1e12, flops / sec['min'] / 1e12],
           'fraction_of_matmul_rate': flops / sec['median'] / (s['matmul_tflops'] * 1e12)}
    differs = lambda a, b: any(not math.isclose(x, y, rel_tol=1e-9) for x, y in zip(a, b)) if isinstance(b, list) else not math.isclose(a, b, rel_tol=1e-9)
    changed = {k: {'recorded': s[k], 'now': v} for k, v in now.items() if differs(s[k], v)}
    if changed: s['rederived'] = {'why': REDERIVED_WHY, 'head_positions': s['head_positions'], 'tokens': s['tokens'], 'figures': changed}
    s.update(now)
    s['memory_by_phase'] = memory_by_phase(s.get('phases_gib'), s.get('plan_phases_gib'))
    over = [k for k, m in s['memory_by_phase'].items() if m['over']]
    if over:
        s['pass'] = False
        if view['verdict'] == 'passed': view['verdict'] = 'failed'
        view['memory_failed'] = ', '.join(f"{k} peak {s['memory_by_phase'][k]['peak_gib']:.1f} GiB above its planned {s['memory_by_phase'][k]['plan_gib']:.1f} GiB"
                                          for k in over)
    s['split_checks'] = split_checks(s['split'], s.get('phases_s'), sec['median'])


def write_report(out: Path, fixed: dict, status: dict, total_s: float, provenance: dict | None = None) -> dict:
    "subset.json and subset.md from the part files and how their processes ended (`fixed`: `report_header`); `provenance`: the run's, when a report is rendered again from its part files (`rerender`)."
    _sibling(); from gpu_check import layout_lines
    from memagent.provenance import provenance as now
    layout = fixed['layout']
    parts = {name: part_view(out, name, status.get(name)) for name, _, _ in PARTS}
    for name in STEP4B: derive_step4b(parts[name], fixed['cpu_simulation'])
    run = [p for p in parts.values() if p['verdict'] != 'not run']
    body = {**{k: layout[k] for k in ('layout', 'reduced_layout', 'reduced_because', 'not_checked')}, 'cpu_simulation': fixed['cpu_simulation'],
            'pass': bool(run) and all(p['verdict'] in ('passed', 'skipped') for p in run), 'parts': parts,
            'caps_s': {n: c for n, c, _ in PARTS}, 'seconds': total_s, 'budget_s': SUBSET_BUDGET_S,
            'within_budget': total_s <= SUBSET_BUDGET_S, 'environment': fixed['environment'],
            'transformer_engine': fixed['transformer_engine'], 'device': fixed['device'],
            'tolerances': TOL, 'sequence_parallel': 'not checked: it needs TP >= 2, so at least 2 GPUs (part cluster)',
            'doctor_rows': layout['rows'], 'step4b_side_by_side': step4b_side_by_side(parts)}
    body['provenance'] = provenance or now()
    if provenance is not None: body['rendered_again'] = {'from': 'the part files the run recorded (unchanged)', 'provenance': now()}
    out.mkdir(parents=True, exist_ok=True)
    (out / 'subset.json').write_text(json.dumps(body, indent=1, default=str))
    (out / 'subset.md').write_text(render_md(layout, body, layout_lines))
    print(f"wrote {out / 'subset.json'}")
    return body


def rerender(out: Path) -> dict:
    "subset.json and subset.md rendered again, by the code of now, from the part files a run recorded and the layout, environment and process records of its subset.json; the part files are read, never written, and the run's provenance is kept."
    rep = json.loads((out / 'subset.json').read_text())
    layout = {**{k: rep[k] for k in ('layout', 'reduced_layout', 'reduced_because', 'not_checked')}, 'rows': rep['doctor_rows']}
    fixed = {'layout': layout, 'cpu_simulation': rep['cpu_simulation'], 'environment': rep['environment'],
             'transformer_engine': rep['transformer_engine'], 'device': rep['device']}
    status = {n: p['process'] for n, p in rep['parts'].items() if p.get('process')}
    return write_report(out, fixed, status, rep['seconds'], provenance=rep['provenance'])


def split_verdict(v: dict) -> str:
    from memagent.bench import split_verdict as sv
    return sv(v)


def _f(x, nd=3):
    return 'n/a' if x is None else (f"{x:.{nd}g}" if isinstance(x, float) else str(x))


def render_md(layout: dict, body: dict, layout_lines) -> str:
    "The report to read: the layout and what was not checked first, then one section per part with its verdict and figures."
    e, P = body['environment'], body['parts']
    L = layout_lines(layout) + ['', f"# gpu_check subset: {'PASS' if body['pass'] else 'FAIL'}"
                                + (' (cpu-simulation: a code-path check at tiny shapes, not a GPU check)' if body['cpu_simulation'] else ''), '',
         f"device {body['device']}; driver {_f(e['driver'])}; CUDA (torch) {_f(e['cuda_runtime_of_torch'])}; torch {_f(e['torch'])}; "
         f"transformers {_f(e['transformers'])}; megatron-core {_f(e['megatron_core'])}; Transformer Engine {_f(e['transformer_engine'])}", '']
    ra = body.get('rendered_again')
    if ra:
        g0, g1 = body['provenance'].get('git', {}), ra['provenance'].get('git', {})
        L += [f"Rendered again from {ra['from']} by the code at {str(g1.get('commit'))[:7]}{' (uncommitted changes)' if g1.get('dirty') else ''}; "
              f"the run itself ran at {str(g0.get('commit'))[:7]}. What the code of now derives differently from the recorded figures is "
              "said in each part: the split's checks, model FLOPs on the positions the head computes, every phase's peak against its plan.", '']
    L += ['| part | verdict | seconds | cap (s) |', '|---|---|---|---|']
    for name, cap, what in PARTS:
        p = P[name]; st = p.get('process') or {}
        L.append(f"| {name} | {p['verdict']} | {_f(st.get('seconds'), 3)} | {cap} |")
    L += ['', f"total {body['seconds']:.1f} s (budget {body['budget_s']} s: {'within' if body['within_budget'] else 'OVER'})", '']
    for name, cap, what in PARTS:
        p = P[name]; r = p.get('results', {})
        L += [f"## {name}: {p['verdict']}", '', what + '.', '']
        if p.get('error'): L += [f"error: `{p['error']}`", '']
        if p.get('memory_failed'): L += [f"memory check FAILED: {p['memory_failed']}", '']
        if name == 'megatron' and r:
            L += ['| recompute | dtype | optimizer | attention | parameters | loss rel diff | grad norm rel diff | state round trip | checkpoint before step 1 | pass |',
                  '|---|---|---|---|---|---|---|---|---|---|']
            for g in r.values():
                c = g['checkpoint_before_first_step']
                L.append(f"| {g['recompute']} | {g['dtype']} | {g['optimizer']} | {g['attention']} | {', '.join(g['parameter_dtypes'])} | "
                         f"{_f(g['loss_rel_diff'])} | {_f(g['grad_norm_rel_diff'])} | {g['optimizer_state_round_trip']} | "
                         f"{c.get('saved') or c.get('error')} | {g['pass']} |")
        elif name == 'weight_sync' and r:
            w = r['weight_sync']
            L.append(f"{w['precision']}, tol {w['tol']:g}: before step {w['before_step'].get('passed')} (max |dlogp| "
                     f"{_f(w['before_step'].get('max_abs_dlogp'))}), after sync {w['after_sync'].get('passed')} "
                     f"({_f(w['after_sync'].get('max_abs_dlogp'))}), missed sync rejected {not w['missed_sync'].get('passed')}")
        elif name == 'trainer' and r:
            L += ['| backend | health | KL step 1 | setup s | step 1 s (rollout / update / sync) | step 2 s | GPU peak GiB | pass |',
                  '|---|---|---|---|---|---|---|---|']
            for g in r.values():
                s = g['steps']
                L.append(f"| {g['backend']} | {g['health']} | {_f(g['kl_step1'])} | {_f(g['setup_s'])} | {_f(s[0]['time_step'])} "
                         f"({_f(s[0]['time_rollout'])} / {_f(s[0]['time_update'])} / {_f(s[0]['time_sync'])}) | "
                         f"{_f(s[-1]['time_step'])} | {_f(g['gpu_peak_gib'])} | {g['pass']} |")
        elif name == 'engine' and r:
            w = r.get('workload', {})
            L.append(f"workload run: {w.get('run')}; shrunk: {w.get('shrunk') or 'no'} (rule: {w.get('rule')})")
            s = r.get('summary')
            if s: L.append(f"engine / generate() tokens/s: median {_f(s['ratio']['median'])} (range {_f(s['ratio']['min'])}..{_f(s['ratio']['max'])}, "
                           f"{s['repeats']} repeats{'; ' + s['stopped'] if s['stopped'] else ''}); goal {s['goal']}: {s['verdict']}")
        elif name in STEP4B and r:
            q = r.get('plan_qwen3_4b')
            if q: L.append(f"Qwen3-4B plan at {q['rows']} x {q['seq_len']} tokens ({q['attention']}): {q['update_allocated_gib']:.1f} GiB allocated in the "
                           f"update, peak {q['update_peak_gib']:.1f} GiB on a {q['gpu_gib']:.1f} GiB card: "
                           f"{'fits' if q['fits'] else 'does not fit'} (runs within {q['headroom']:.0%} of the card)")
            if r.get('rows_reduced'): L.append(f"rows reduced: {r['rows_reduced']}")
            if r.get('skipped'): L.append(f"skipped: {r['skipped']}")
            s = r.get('step')
            if s: L.append(f"ran {s['rows']} x {s['seq_len']} tokens ({s['attention']}, {s['dtype']}): {_f(s['seconds_per_step']['median'])} s a step "
                           f"(range {_f(s['seconds_per_step']['min'])}..{_f(s['seconds_per_step']['max'])}), {_f(s['tokens_per_s'])} tokens/s, "
                           f"{_f(s['model_tflops'])} model TFLOP/s = {_f(s['fraction_of_matmul_rate'])} of the {_f(s['matmul_tflops'])} TFLOP/s "
                           f"matmul rate measured here; peak {_f(s['peak_gib'])} GiB against the plan's {_f(s['plan_gib'])} GiB "
                           f"(peak / plan {_f(s['peak_over_plan'])})")
            if s and s.get('rederived'):
                d = s['rederived']
                L.append(f"re-derived at rendering: {d['why']} ({d['head_positions']} of {d['tokens']} positions); recorded: "
                         + ', '.join(f"{k} {_f(v['recorded']) if not isinstance(v['recorded'], list) else '..'.join(_f(x) for x in v['recorded'])}"
                                     for k, v in d['figures'].items()))
            if s and s.get('phases_gib'):
                ph, mb = s['phases_gib'], s.get('memory_by_phase', {})
                L.append("peak by phase (GiB): " + ', '.join(f"{k} {_f(m['peak_gib'])} (plan {_f(m['plan_gib'])}{': OVER its plan' if m['over'] else ''})"
                                                             for k, m in mb.items())
                         + f"; held before the step {_f(ph['held before the step'])}, after the backward {_f(ph['held after the backward'])}")
            if s and s.get('phases_s'):
                t = s['phases_s']
                L.append("time by phase (one step, at device synchronizations): " + ', '.join(f"{k} {_f(v)} s" for k, v in t.items())
                         + f" (optimizer step {t['optimizer step'] / sum(t.values()):.0%})")
            if s:
                sp, v = s['split'], s['split_checks']
                if v['reliable']:
                    L.append(f"one profiled step, {sp['clock']}: " + ', '.join(f"{k} {x:.0%}" for k, x in sp['share'].items()) + f"; {split_verdict(v)}")
                else:
                    L.append(f"one profiled step, {sp['clock']}: {split_verdict(v)}. Seconds it credited per part, not a split of the step: "
                             + ', '.join(f"{k} {_f(x)}" for k, x in sp['seconds'].items()))
        elif name == 'precision' and r:
            t, c, k = r.get('training', {}), r.get('bf16_vs_fp32'), r.get('control_untrained')
            L.append(f"trained loss {_f(t.get('trained_loss'))} against ln V = {_f(t.get('uniform_loss_ln_vocab'))} (uniform)")
            if c: L.append(f"bf16 vs fp32: loss rel diff {_f(c['loss_rel_diff'])}, grad norm rel diff {_f(c['grad_norm_rel_diff'])} "
                           f"(tol {TOL['loss_rel']:g} / {TOL['grad_norm_rel']:g}): {c['pass']}")
            if k: L.append(f"control (untrained model, same tolerance): loss rel diff {_f(k['loss_rel_diff'])}, grad norm rel diff "
                           f"{_f(k['grad_norm_rel_diff'])}: outside the tolerance {k['outside_tolerance']}")
        L.append('')
    sb = body.get('step4b_side_by_side')
    if sb:
        L += ['## The Qwen3-4B step side by side', '',
              '| part | attention | recompute | tokens | s/step | tokens/s | model TFLOP/s | of matmul rate | peak / plan GiB | largest parts of one profiled step |',
              '|---|---|---|---|---|---|---|---|---|---|']
        for x in sb['rows']:
            top = sorted(x['split'].items(), key=lambda kv: -kv[1])[:3]
            over = f" (phase over plan: {', '.join(x['memory_over_plan'])})" if x.get('memory_over_plan') else ''
            L.append(f"| {x['part']} | {x['attention']} | {x['recompute']} | {x['rows']} x {x['seq_len']} | {_f(x['seconds_per_step'])} | "
                     f"{_f(x['tokens_per_s'])} | {_f(x['model_tflops'])} | {_f(x['fraction_of_matmul_rate'])} | {_f(x['peak_gib'])} / {_f(x['plan_gib'])}{over} | "
                     + (', '.join(f"{k} {v:.0%}" for k, v in top) if x['split_reliable'] else 'not known: the split is not reliable (see the part)') + ' |')
        g = sb.get('sdpa_over_local')
        if g:
            f = sb['sdpa_fraction_of_matmul_rate']
            L += ['', f"SDPA over the local spec, model TFLOP/s at full recompute: {_f(g['median'])} (range {_f(g['min'])}..{_f(g['max'])} from the "
                      f"repeats' extremes); goal {g['goal']}: {g['verdict']}. SDPA reaches {_f(f['value'])} of the matmul rate (aim "
                      f"{f['aim']:g}: {'reached' if f['reached'] else 'not reached'}); "
                      + (f"its largest part of the step is {sb['sdpa_largest_part']['part']} ({sb['sdpa_largest_part']['share']:.0%})."
                         if sb['sdpa_largest_part']['reliable'] else
                         f"where its time goes is not known from this run: {sb['sdpa_largest_part']['verdict']}.")]
        L.append('')
    return '\n'.join(L)
