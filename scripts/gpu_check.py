"""The Python half of scripts/gpu_check.sh: the plans it prints, the preset it picks, the layout it checks, and the checks that need a GPU.

    python scripts/gpu_check.py preset  --models DIR|none --gpus N [--reduced]   # the smoke's preset and overrides (YAML; layout in its first lines)
    python scripts/gpu_check.py layout  --part subset|cluster --gpus N [--models DIR] [--reduced] [--cpu-simulation]
                                                                    # the layout as configured, or the refusal (exit 3) naming
                                                                    #   the memagent-doctor rows that fail and their fixes
    python scripts/gpu_check.py plan    --preset NAME --gpus-per-node N [--gpu-gb G]
    python scripts/gpu_check.py subset  --out DIR [--cpu-simulation] [--parts a,b]   # one GPU: the parts of scripts/gpu_subset.py,
                                                                    #   each in its own process under its own cap
    python scripts/gpu_check.py part NAME --out DIR [--cpu-simulation]   # one part (what `subset` runs)
    python scripts/gpu_check.py render --out DIR                     # subset.json and subset.md again from the part files a run
                                                                    #   recorded (never written), by the code of now
    python scripts/gpu_check.py compare --params FILE --gpus N --out DIR   # SGLang vs HF tokens/s, megatron vs torch step time,
                                                                    #   the weight check after an SGLang sync

`preset`, `layout` and `plan` run anywhere (CI runs them through `gpu_check.sh --dry-run`); `subset` and `compare` refuse to
run without CUDA, except `subset --cpu-simulation`: the subset's own parts on CPU at tiny shapes (the CPU stand-in optimizer),
a named reduced layout that its report says it is. Every result file carries the provenance of `memagent.provenance`.

Layouts are never changed silently. A part checks its preset's layout as configured, or refuses (the fast rows of
`memagent.doctor`, through `require`: the failing row, what was found, what is needed, the fix). Only `--reduced` runs a named
reduced layout (`REDUCED_LAYOUTS`), and every report starts with `layout: as_configured | reduced` and the parts not checked.

The weight check (`memagent.runcheck.weight_check`, tolerance `WEIGHT_TOL['gpu-bf16']`, not yet measured on a GPU): the
engine's teacher-forced log-probs of a fixed prompt against the trainer's after a sync. `subset` checks the megatron
policy's own log-probs against an in-process HF engine before a step and after the step's sync (both must pass), and an
engine that missed the sync (must fail); `compare` checks an SGLang server before and after a sync through
`/update_weights_from_disk` (both must pass) and that the weights it held before are rejected afterwards. The smoke that
`gpu_check.sh` runs checks its engines after every sync itself (its `weights_synced[step N]` gates).

The subset's parts, their caps and what each checks are in `scripts/gpu_subset.py` (`PARTS`): megatron-core in bf16 with its
optimizer per recompute mode, the weight check after a sync, the in-process Trainer for 2 steps with each backend, the
in-process engine against generate() on a GPU-sized workload, the megatron step at Qwen3-4B shapes with the local spec's
attention and with SDPA (full recompute), SDPA with selective recompute and Transformer Engine where it is installed, side
by side against the matmul rate and the plan with a profiled split of the step, and a bf16-vs-fp32 step that can fail.
Each runs in its own process under its cap and writes its result as it goes; the report is rendered again after every
part, so a part that fails or hangs hides nothing of the others. The caps add up to 9 minutes and the subset is meant to
take under 7 on one H200 (`SUBSET_BUDGET_S`, with each part's seconds in the report); `--parts` runs a chosen few.
"""
from __future__ import annotations
import argparse, json, sys, time
from pathlib import Path

FROZEN_MODELS = (('Qwen3-4B', 'qwen3-4b-frozen'), ('Qwen3-0.6B', 'qwen3-0.6b-pilot'))


def find_model(models: str) -> tuple[str, str | None]:
    "(preset, model path or hub id) for the largest recipe model present locally; ('tiny', None) when none is and no folder was named. A named folder (`--models`, MEMAGENT_MODELS) that is missing or holds neither recipe model is refused (exit 2), never read as 'none'."
    from memagent.models import known_models
    if models != 'none':
        d = Path(models)
        expected = ', '.join(f"{d / name}/config.json" for name, _ in FROZEN_MODELS)
        if not d.is_dir():
            print(f"gpu_check.py: --models {models}: no such folder (it should hold {expected}); "
                  "leave --models out to use the hub cache or the tiny model", file=sys.stderr)
            sys.exit(2)
        if not any((d / name / 'config.json').is_file() for name, _ in FROZEN_MODELS):
            print(f"gpu_check.py: --models {models}: holds neither recipe model (looked for {expected}); "
                  "leave --models out to use the hub cache or the tiny model", file=sys.stderr)
            sys.exit(2)
    hub = known_models()['hub cache']
    for name, preset in FROZEN_MODELS:
        if models != 'none' and (Path(models) / name / 'config.json').is_file(): return preset, str(Path(models) / name)
        if f'Qwen/{name}' in hub: return preset, f'Qwen/{name}'
    return 'tiny', None


def smoke_params(models: str, gpus: int, reduced: str | None = None) -> dict:
    "Parameters of nbs/smoke.ipynb for the colocated layout on `gpus` GPUs of one node: the preset's layout as configured, or the named reduced one."
    preset, path = find_model(models)
    ov = {'batch.n_gpus': gpus, 'rollout.colocate': True, 'rollout.engine': 'sglang', 'rollout.gpus_per_engine': min(2, gpus)}
    if preset == 'tiny':   # the frozen layout around a random tiny Qwen3: megatron, TP 2 when there are GPUs for it
        ov.update({'backend': 'megatron', 'model.dtype': 'bfloat16', 'batch.tp': 2 if gpus % 2 == 0 else 1,
                   'batch.distributed_optimizer': True, 'batch.recompute': 'selective', 'batch.sequence_parallel': gpus % 2 == 0})
    if path is not None: ov['model.name'] = path
    if reduced is not None: ov.update(REDUCED_LAYOUTS[reduced]['overrides'])
    return {'preset': preset, 'overrides': ov, 'world_size': gpus}


# The layouts `--reduced` (or `--cpu-simulation`) may run instead of the configured one: what they change and what they leave unchecked.
REDUCED_LAYOUTS = {
    'no-te': {'when': 'Transformer Engine is not installed (--reduced)',
              'overrides': {'batch.sequence_parallel': False, 'batch.attention': 'sdpa'},
              'not_checked': ["Transformer Engine attention (the reduced layout runs the local spec with the fused SDPA core attention)",
                              'sequence parallel (the reduced layout turns it off; it needs Transformer Engine)']},
    'cpu-simulation': {'when': 'explicit --cpu-simulation: the subset\'s code path on CPU, not a GPU check',
                       'overrides': {'model.dtype': 'float32', 'batch.distributed_optimizer': False},
                       'not_checked': ['bf16 with fp32 main grads (CPU runs fp32)',
                                       "megatron-core's optimizer and its distributed optimizer (CPU runs the stand-in CpuMainParamOptimizer)",
                                       'Transformer Engine attention (CPU runs the local spec)',
                                       'peak GPU memory against the plan (no GPU)',
                                       "the gpu-bf16 weight-check tolerance (CPU checks WEIGHT_TOL['cpu-fp32'])"]},
}
SP_ONE_GPU = 'sequence parallel (needs TP >= 2, so at least 2 GPUs: not checked on one GPU; part cluster checks it)'


def layout_record(cfg, world_size: int, what: str, reduced: str | None = None, not_checked=()) -> dict:
    "`layout: as_configured | reduced`, the parts not checked, the fast memagent-doctor rows of `cfg` and the refusal (`require`'s message) if any fails."
    from memagent.doctor import DoctorError, doctor, require
    rows = doctor(cfg, world_size, fast_only=True)
    try: require(rows, what); refused = None
    except DoctorError as e: refused = str(e)
    nc = list(REDUCED_LAYOUTS[reduced]['not_checked'] if reduced else []) + [x for x in not_checked if x]
    return {'layout': 'reduced' if reduced else 'as_configured', 'reduced_layout': reduced,
            'reduced_because': REDUCED_LAYOUTS[reduced]['when'] if reduced else None, 'not_checked': nc, 'refused': refused,
            'failing_rows': [r.name for r in rows if r.verdict == 'fail'], 'rows': [r.to_dict() for r in rows]}


def cluster_layout(models: str, gpus: int, reduced: bool = False) -> tuple[dict, dict]:
    "(smoke parameters, layout record) of part cluster: as configured; with `reduced` and Transformer Engine missing, the named 'no-te' layout."
    from memagent.config import get_preset
    p = smoke_params(models, gpus)
    what = f"gpu_check part cluster: preset {p['preset']!r} in its colocated layout on {gpus} GPUs"
    rec = layout_record(get_preset(p['preset'], p['overrides']), gpus, what)
    if reduced and 'Transformer Engine' in rec['failing_rows']:
        p = smoke_params(models, gpus, 'no-te')
        rec = layout_record(get_preset(p['preset'], p['overrides']), gpus, what + ", reduced layout 'no-te'", 'no-te')
    elif reduced: rec['reduced_because'] = '--reduced given, not needed: the layout as configured passes the Transformer Engine row'
    return p, rec


def subset_layout(cpu_simulation: bool = False) -> tuple[object, dict]:
    "(config, layout record) of part subset: the tiny model in the frozen recipe's precision on one GPU, or the named 'cpu-simulation' layout."
    from memagent.backends.megatron import have_transformer_engine
    cfg = tiny_megatron('selective', 'float32') if cpu_simulation else tiny_megatron()
    te = None if cpu_simulation or have_transformer_engine() else 'Transformer Engine attention (not installed: the local spec runs)'
    return cfg, layout_record(cfg, 1, 'gpu_check part subset: tiny Qwen3, megatron-core' + (' on CPU (cpu-simulation)' if cpu_simulation
                              else ' bf16 + distributed optimizer on one GPU'), 'cpu-simulation' if cpu_simulation else None, (te, SP_ONE_GPU))


def layout_lines(rec: dict, prefix: str = '') -> list[str]:
    "The first lines of every report: the layout, why it is reduced, the parts not checked."
    lines = [f"{prefix}layout: {rec['layout']}" + (f" ({rec['reduced_layout']}: {rec['reduced_because']})" if rec['reduced_layout']
                                                  else (f" ({rec['reduced_because']})" if rec.get('reduced_because') else ''))]
    lines.append(f"{prefix}not checked: " + ('; '.join(rec['not_checked']) or 'nothing'))
    return lines


def tiny_megatron(recompute: str = 'selective', dtype: str = 'bfloat16', distributed_optimizer: bool | None = None):
    "The tiny model in the frozen recipe's training precision on one GPU (its distributed optimizer with bf16 unless told)."
    from memagent.config import get_preset
    dopt = dtype == 'bfloat16' if distributed_optimizer is None else distributed_optimizer
    return get_preset('tiny', {'backend': 'megatron', 'model.dtype': dtype, 'batch.n_gpus': 1, 'batch.tp': 1,
                               'batch.distributed_optimizer': dopt, 'batch.recompute': recompute})


def config_for(preset: str, overrides: dict | None = None):
    from memagent.config import get_preset
    return tiny_megatron() if preset == 'tiny-megatron' else get_preset(preset, overrides or {})


def cmd_preset(a):
    import yaml
    p, rec = cluster_layout(a.models, a.gpus, a.reduced)
    print('\n'.join(layout_lines(rec, '# ')))
    print(yaml.safe_dump(p, sort_keys=False).rstrip())


def cmd_layout(a):
    "Print the part's layout and what it leaves unchecked; a refusal goes to stderr with exit 3."
    rec = (subset_layout(a.cpu_simulation)[1] if a.part == 'subset' else cluster_layout(a.models, a.gpus, a.reduced)[1])
    print('\n'.join(layout_lines(rec, f"{a.part}: ")))
    if rec['refused']:
        print(f"gpu_check: refused, not downgraded: {rec['refused']}", file=sys.stderr)
        sys.exit(3)


def cmd_plan(a):
    from memagent.plan import Cluster, make_plan
    cfg = config_for(a.preset, json.loads(a.overrides) if a.overrides else None)
    p = make_plan(cfg, Cluster(gpus_per_node=a.gpus_per_node, gpu_gb=a.gpu_gb, transformer_engine=a.transformer_engine != 'no'))
    print(f"plan of {a.preset} ({cfg.model.name}) on {a.gpus_per_node} x {a.gpu_gb:g} GB:")
    for row in p.table(): print('  ' + '  '.join(f"{k}={v}" for k, v in row.items()))
    print('  ' + p.verdict())
    return p


def _need_cuda(what: str):
    import torch
    if not torch.cuda.is_available(): sys.exit(f"gpu_check.py {what}: needs a CUDA device (this is the GPU-only part)")


def _write(out: Path, name: str, body: dict):
    from memagent.provenance import provenance
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps({**body, 'provenance': provenance()}, indent=1, default=str))
    print(f"wrote {out / name}")


def _fixed_batch(vocab: int, tokens: int, rows: int = 2, seed: int = 0) -> dict:
    import torch
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (rows, tokens // rows), generator=g)
    resp = torch.zeros_like(ids, dtype=torch.bool); resp[:, ids.shape[1] // 2:] = True
    return {'input_ids': ids, 'attention_mask': torch.ones_like(ids, dtype=torch.bool), 'response_mask': resp}


def _step(be, batch) -> tuple[float, float]:
    lp = be.logprobs(batch)
    n = batch['response_mask'][:, 1:].sum()
    loss = -(lp.sum() / n)
    be.backward(loss)
    return float(loss.detach()), be.step()


def environment() -> dict:
    "Driver, CUDA, GPUs and the versions that decide what the subset measured (from `memagent.doctor.probe_env`, no Ray)."
    from memagent.doctor import dist_version, probe_env
    e = probe_env()
    return {'python': e.python_version, 'driver': e.driver_version, 'cuda_runtime_of_torch': e.torch_cuda, 'cuda_available': e.cuda_available,
            'gpus': [g.name for g in e.gpus], 'torch': e.torch_version, 'transformers': dist_version('transformers'),
            'megatron_core': e.megatron_version, 'transformer_engine': e.te_version, 'transformer_engine_pytorch': e.te_pytorch,
            'sglang': e.sglang_version, 'nccl': e.nccl_version, 'problems': e.problems}


def checkpoint_before_first_step(be) -> dict:
    "The backend's own save path (`state_dict()`) before any optimizer step, and loading what it returned back: what came back, recorded."
    from memagent.checkpoint import no_optimizer_state_reason
    try:
        state = be.state_dict()
        reason = no_optimizer_state_reason(state.get('optimizer') if isinstance(state, dict) else state)
        be.load_state_dict(be.hf_state_dict(), state)
        return {'saved': 'no_optimizer_state marker' if reason else 'optimizer state', 'reason': reason,
                'keys': sorted(state) if isinstance(state, dict) else type(state).__name__,
                'loaded_back': True, 'fresh_reason': getattr(be.optimizer, 'fresh_reason', None), 'pass': True}
    except Exception as e:   # the save or the load before a step raised: that is the finding
        return {'saved': None, 'error': f"{type(e).__name__}: {e}", 'loaded_back': False, 'pass': False}


def cmd_subset(a):
    "One GPU: every part of `gpu_subset.PARTS` in its own process under its own cap, then the report; `--cpu-simulation`: the same parts on CPU at tiny shapes."
    if not a.cpu_simulation: _need_cuda('subset')
    from gpu_subset import run_subset, step4b_plan, STEP4B, STEP4B_HEADROOM
    _, layout = subset_layout(a.cpu_simulation)
    if layout['refused']: sys.exit(f"gpu_check.py subset: refused, not downgraded: {layout['refused']}")
    print('\n'.join(layout_lines(layout)))
    if a.cpu_simulation:     # what the GPU run would run at Qwen3-4B shapes: the plan, on an H200-sized and an 80 GiB card
        from memagent.plan import GiB
        for name, (att, rc, rows, L) in STEP4B.items():
            for gib in (139.8, 80.0):
                _, p = step4b_plan(rc, rows, L, gib, attention=att)
                print(f"  {name} on a GPU would run: Qwen3-4B, {rows} x {L} tokens, recompute {rc}, attention {p.details['attention']}: "
                      f"the plan's update allocates {p.allocated('update') / GiB:.1f} GiB, peak {p.peak('update') / GiB:.1f} GiB of {gib:g} GiB: "
                      f"{'fits' if p.peak('update') <= STEP4B_HEADROOM * gib * GiB else f'over {STEP4B_HEADROOM:.0%} of the card: fewer rows or skipped'}")
    body = run_subset(Path(a.out), a.cpu_simulation, a.parts.split(',') if a.parts else None)
    print(f"wrote {Path(a.out) / 'subset.md'}")
    if not body['pass']: sys.exit('gpu_check.py subset: a part failed, timed out or did not run (see subset.md)')


def cmd_part(a):
    "One part of the subset in this process (what `subset` runs under a cap)."
    from gpu_subset import run_part, PARTS
    if a.name not in (names := [n for n, _, _ in PARTS]):      # before the part's file is written (a name is also a file name)
        print(f"gpu_check.py part: unknown part {a.name!r}; the parts: {names}", file=sys.stderr); sys.exit(2)
    if not a.cpu_simulation: _need_cuda(f'part {a.name}')
    run_part(a.name, Path(a.out), a.cpu_simulation)


def cmd_render(a):
    "A subset's report rendered again from the part files it recorded, keeping the run's provenance (anywhere: no GPU needed)."
    from gpu_subset import rerender
    out = Path(a.out)
    if not (out / 'subset.json').is_file() or not (out / 'parts').is_dir():
        print(f"gpu_check.py render: {out} holds no subset.json and parts/ of a subset run", file=sys.stderr); sys.exit(2)
    body = rerender(out)
    print(f"wrote {out / 'subset.md'}: {'PASS' if body['pass'] else 'FAIL'}")


def _summary(r: dict) -> dict:
    "A weight check's numbers without its log-prob lists."
    return {k: v for k, v in r.items() if k not in ('trainer', 'engine')}


def weight_sync_check(device: str = 'cuda', dtype: str = 'bfloat16', tokens: int | None = None) -> dict:
    "The megatron policy's own log-probs of the fixed prompt against HF engines: before a step, after the step's sync (pass), and one that missed it (fail)."
    from memagent.engines import HFEngine
    from memagent.models import load_model, load_tokenizer
    from memagent.backends.megatron import MegatronBackend
    from memagent.policy import prompt_logprobs
    from memagent.runcheck import WEIGHT_PROMPT, WEIGHT_TOL, precision_key, weight_check, weight_prompt_ids
    key = precision_key(device.startswith('cuda'), dtype)
    tol, cfg = WEIGHT_TOL[key], tiny_megatron('selective', dtype)
    ids = weight_prompt_ids(load_tokenizer('tiny-qwen3'))
    be = MegatronBackend.from_config(cfg, load_model('tiny-qwen3', dtype))
    synced, missed = HFEngine(load_model('tiny-qwen3', dtype, device)), HFEngine(load_model('tiny-qwen3', dtype, device))
    policy = lambda ids: prompt_logprobs(be, ids)     # the trainer's side of the weight check: the policy's own forward
    try:
        before, missed0 = weight_check(synced, policy, ids, tol), weight_check(missed, policy, ids, tol)
        _step(be, _fixed_batch(synced.vocab_size, tokens or cfg.batch.max_tokens_per_micro))
        synced.sync_weights(be.hf_state_dict())
        after = weight_check(synced, policy, ids, tol, previous=before)
        stale = weight_check(missed, policy, ids, tol, previous=missed0)
    finally: be.close()
    return {'prompt': WEIGHT_PROMPT, 'prompt_ids': ids, 'precision': key, 'tol': tol, 'trainer_side': 'MegatronBackend.logprobs',
            'before_step': _summary(before), 'after_sync': _summary(after), 'missed_sync': _summary(stale),
            'pass': before['passed'] and after['passed'] and not stale['passed']}


def _perturbed(sd: dict, rel: float = 0.5, seed: int = 0) -> dict:
    "Every tensor plus seeded noise of `rel` times its own standard deviation: weights far enough from the served ones that the check must see them (tiny Qwen3: max |dlogp| 0.21 at 0.5, 0.03 at 0.05, measured on CPU)."
    import torch
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in sd.items():
        noise = torch.randn(v.shape, generator=g).to(v.device)
        out[k] = (v.float() + rel * (v.float().std() if v.numel() > 1 else 0.0) * noise).to(v.dtype)
    return out


def sglang_sync_check(eng, ids, before: list, after: list, sync) -> dict:
    "An SGLang server against HF teacher-forced values: its weights (`before`), then after `sync()` the new ones (`after`), and the old ones no longer."
    from memagent.runcheck import WEIGHT_TOL, weight_check
    tol = WEIGHT_TOL['gpu-bf16']
    first = weight_check(eng, before, ids, tol)
    sync()
    synced = weight_check(eng, after, ids, tol, previous=first)
    old = weight_check(eng, before, ids, tol)
    return {'prompt_ids': ids, 'tol': tol, 'trainer_side': 'HFEngine.prompt_logprobs (transformers, same weights)',
            'before_sync': _summary(first), 'after_sync': _summary(synced), 'old_weights_after_sync': _summary(old),
            'pass': first['passed'] and synced['passed'] and not old['passed']}


def _time(fn, repeats: int = 2) -> float:
    import torch
    fn(); torch.cuda.synchronize()                      # warm-up
    t0 = time.perf_counter()
    for _ in range(repeats): fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats


def cmd_compare(a):
    "SGLang vs the HF engine on the same prompts (tokens/s), and the megatron vs torch update on the same rows (seconds)."
    _need_cuda('compare')
    import torch, yaml
    from memagent.config import get_preset
    from memagent.engines import HFEngine, SamplingParams, SGLangServer, SGLangEngine
    from memagent.checkpoint import push_weights
    from memagent.models import load_model, load_tokenizer, model_dir
    from memagent.data import make_synthetic
    from memagent.rollout import rollout
    from memagent.credit import trajectories_to_rows
    from memagent.transfer import InProcessChannel, RayChannel, layout_step
    from memagent.colocate import make_group
    from memagent.runcheck import weight_prompt_ids
    p = yaml.safe_load(Path(a.params).read_text())
    cfg = get_preset(p['preset'], {**p['overrides'], 'rollout.colocate': False, 'rollout.engine': 'hf'})
    # every configuration and count this compares, checked before the server's log or the sync files are written
    if a.gpus < 1 or a.gpus > torch.cuda.device_count():
        sys.exit(f"gpu_check.py compare: --gpus {a.gpus}: this machine has {torch.cuda.device_count()} GPUs")
    cfgs = {backend: get_preset(p['preset'], {**p['overrides'], 'rollout.colocate': False, 'rollout.engine': 'hf', 'backend': backend,
                                              **({'batch.tp': 1, 'batch.sequence_parallel': False} if backend == 'torch' else {})})
            for backend in ('torch', 'megatron')}
    tok, out = load_tokenizer(cfg.model.tokenizer or cfg.model.name), Path(a.out)
    prompts = [tok(f"Summarize item {i}: " + "memory " * 400)['input_ids'] for i in range(64)]
    sp = SamplingParams(max_new_tokens=128, temperature=1.0, top_p=1.0)
    res = {}
    hf = HFEngine(load_model(cfg.model.name, cfg.model.dtype, 'cuda'), tok)
    t0 = time.perf_counter(); r = hf.generate(prompts, sp); dt = time.perf_counter() - t0
    res['hf_tokens_per_s'] = sum(len(x.output_ids) for x in r) / dt
    # the weight check's reference values: the served weights, then perturbed ones (what a sync sends next)
    wids = weight_prompt_ids(tok)
    lp_base = hf.prompt_logprobs(wids)
    new_sd = _perturbed(hf.model.state_dict())
    hf.update_weights(state_dict=new_sd); lp_new = hf.prompt_logprobs(wids)
    hf.model.to('cpu'); new_sd = {k: v.cpu() for k, v in new_sd.items()}; torch.cuda.empty_cache()   # the GPU for SGLang
    try: path = model_dir(cfg.model.name)
    except FileNotFoundError: path = cfg.model.name
    with SGLangServer(path, tp=1, context_length=cfg.rollout.context_length, mem_fraction=0.8, log_path=out / 'sglang.log') as srv:
        eng = SGLangEngine([srv.url])
        t0 = time.perf_counter(); r = eng.generate(prompts, sp); dt = time.perf_counter() - t0
        res['sglang_tokens_per_s'] = sum(len(x.output_ids) for x in r) / dt
        res['weight_check'] = sglang_sync_check(eng, wids, lp_base, lp_new, lambda: push_weights(eng, new_sd, hf.model, tok, out / 'sync'))
        print(json.dumps(res['weight_check']))
    del hf, new_sd
    res['sglang_over_hf'] = res['sglang_tokens_per_s'] / res['hf_tokens_per_s']
    # the same rows through each backend's policy group, laid out as the trainer lays them out
    exs = make_synthetic(cfg.grpo.prompts_per_step, num_tokens=cfg.chunking.chunk_tokens * 2, seed=cfg.seed, tokenizer=tok)
    hf = HFEngine(load_model(cfg.model.name, cfg.model.dtype, 'cuda'), tok)
    trajs = rollout(exs, hf, tok, cfg, seed=cfg.seed)
    del hf; torch.cuda.empty_cache()
    for tr in trajs: tr.reward = float(len(tr.final_text) % 2)   # any reward with variance: this times the update only
    rows, _ = trajectories_to_rows(trajs, cfg)
    for backend, c in cfgs.items():
        group = make_group(c, tok.pad_token_id, a.gpus)
        try:
            put, k = layout_step(rows, group.dp_size, c.optim.mini_batches)[0], [0]
            chan = InProcessChannel(len(put) + 1, 1) if a.gpus == 1 else RayChannel(len(put) + group.dp_size, group.dp_size)
            def once():
                k[0] += 1; chan.put(k[0], put); group.update(chan, k[0], c.rollout.request_timeout_s)
            res[f'{backend}_update_s'] = _time(once)
        finally:
            group.close(); del group                       # its policy, reference and optimizer leave the GPU before the next
            import gc; gc.collect(); torch.cuda.empty_cache()
    res['megatron_over_torch_time'] = res['megatron_update_s'] / res['torch_update_s']
    res['rows'] = len(rows)
    res['peak_vs_plan'] = peak_vs_plan(p, a.smoke_run, a.gpus)
    head = [l[2:] for l in Path(a.params).read_text().splitlines() if l.startswith('# ')]   # the layout lines `preset` wrote first
    _write(out, 'compare.json', {'layout': next((l.split(': ', 1)[1] for l in head if l.startswith('layout: ')), 'unknown (no layout line in the params)'),
                                 'not_checked': next((l.split(': ', 1)[1] for l in head if l.startswith('not checked: ')), 'unknown'),
                                 'params': p, 'results': res})
    if not res['weight_check']['pass']: sys.exit('gpu_check.py compare: the SGLang weight check failed (see compare.json)')


def peak_vs_plan(p: dict, smoke_run: str | None, gpus: int) -> dict | None:
    "The smoke run's largest per-rank GPU peak during its updates (`gpu_peak_gib`) against the plan's update-phase terms torch allocates."
    from memagent.config import get_preset
    from memagent.backends.megatron import have_transformer_engine
    from memagent.plan import ALLOCATED_TERMS, Cluster, GiB, make_plan
    if not smoke_run or not (Path(smoke_run) / 'metrics.jsonl').is_file(): return None
    import torch
    peaks = [json.loads(l).get('gpu_peak_gib') for l in open(Path(smoke_run) / 'metrics.jsonl')]
    peaks = [x for x in peaks if x is not None]
    if not peaks: return None
    plan = make_plan(get_preset(p['preset'], p['overrides']),
                     Cluster(gpus_per_node=gpus, gpu_gb=torch.cuda.get_device_properties(0).total_memory / GiB,
                             transformer_engine=have_transformer_engine()))
    planned = plan.allocated('update') / GiB
    return {'measured_peak_gib': max(peaks), 'planned_gib': planned, 'measured_over_planned': max(peaks) / planned,
            'terms': [t for t in ALLOCATED_TERMS if t in plan.update]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest='cmd', required=True)
    s = sub.add_parser('preset'); s.add_argument('--models', default='none'); s.add_argument('--gpus', type=int, default=8)
    s.add_argument('--reduced', action='store_true', help="Transformer Engine missing: the named reduced layout 'no-te'")
    s = sub.add_parser('layout'); s.add_argument('--part', choices=('subset', 'cluster'), required=True)
    s.add_argument('--models', default='none'); s.add_argument('--gpus', type=int, default=8)
    s.add_argument('--reduced', action='store_true'); s.add_argument('--cpu-simulation', action='store_true')
    s = sub.add_parser('plan'); s.add_argument('--preset', required=True); s.add_argument('--gpus-per-node', type=int, default=8)
    s.add_argument('--gpu-gb', type=float, default=80.0); s.add_argument('--overrides', default=None, help='JSON dict of dotted keys')
    s.add_argument('--transformer-engine', choices=('yes', 'no'), default='yes', help="whether the cluster's GPUs have Transformer Engine (the attention the plan resolves)")
    s = sub.add_parser('subset'); s.add_argument('--out', required=True)
    s.add_argument('--cpu-simulation', action='store_true', help="the subset's code path on CPU (tiny shapes, the CPU stand-in optimizer): recorded as such")
    s.add_argument('--parts', default=None, help='comma-separated part names (default: every part of gpu_subset.PARTS)')
    s = sub.add_parser('part'); s.add_argument('name'); s.add_argument('--out', required=True); s.add_argument('--cpu-simulation', action='store_true')
    s = sub.add_parser('render'); s.add_argument('--out', required=True, help="a subset run's folder (its subset.json and parts/)")
    s = sub.add_parser('compare'); s.add_argument('--params', required=True); s.add_argument('--gpus', type=int, required=True)
    s.add_argument('--out', required=True); s.add_argument('--smoke-run', default=None, help="the smoke's run directory (its metrics.jsonl)")
    a = ap.parse_args(argv)
    {'preset': cmd_preset, 'layout': cmd_layout, 'plan': cmd_plan, 'subset': cmd_subset, 'part': cmd_part, 'render': cmd_render, 'compare': cmd_compare}[a.cmd](a)


if __name__ == '__main__':
    main()
