"""The Python half of scripts/gpu_check.sh: the plans it prints, the preset it picks, and the checks that need a GPU.

    python scripts/gpu_check.py preset  --models DIR|none          # the smoke's preset and overrides for the models found (YAML)
    python scripts/gpu_check.py plan    --preset NAME --gpus-per-node N [--gpu-gb G]
    python scripts/gpu_check.py subset  --out DIR                   # one GPU: megatron-core bf16 + its optimizer + recompute,
                                                                    #   the weight check after a sync (megatron -> HF engine)
    python scripts/gpu_check.py compare --params FILE --gpus N --out DIR   # SGLang vs HF tokens/s, megatron vs torch step time,
                                                                    #   the weight check after an SGLang sync

`preset` and `plan` run anywhere (CI runs them through `gpu_check.sh --dry-run`); `subset` and `compare` refuse to
run without CUDA. Every result file carries the provenance of `memagent.provenance`.

The weight check (`memagent.runcheck.weight_check`, tolerance `WEIGHT_TOL['gpu-bf16']`, not yet measured on a GPU): the
engine's teacher-forced log-probs of a fixed prompt against the trainer's after a sync. `subset` checks the megatron
policy's own log-probs against an in-process HF engine before a step and after the step's sync (both must pass), and an
engine that missed the sync (must fail); `compare` checks an SGLang server before and after a sync through
`/update_weights_from_disk` (both must pass) and that the weights it held before are rejected afterwards. The smoke that
`gpu_check.sh` runs checks its engines after every sync itself (its `weights_synced[step N]` gates).
"""
from __future__ import annotations
import argparse, json, sys, time
from pathlib import Path

FROZEN_MODELS = (('Qwen3-4B', 'qwen3-4b-frozen'), ('Qwen3-0.6B', 'qwen3-0.6b-pilot'))


def find_model(models: str) -> tuple[str, str | None]:
    "(preset, model path or hub id) for the largest recipe model present locally; ('tiny', None) when none is."
    from memagent.models import known_models
    hub = known_models()['hub cache']
    for name, preset in FROZEN_MODELS:
        if models != 'none' and (Path(models) / name / 'config.json').is_file(): return preset, str(Path(models) / name)
        if f'Qwen/{name}' in hub: return preset, f'Qwen/{name}'
    return 'tiny', None


def smoke_params(models: str, gpus: int) -> dict:
    "Parameters of nbs/smoke.ipynb for the colocated layout on `gpus` GPUs of one node."
    preset, path = find_model(models)
    ov = {'batch.n_gpus': gpus, 'rollout.colocate': True, 'rollout.engine': 'sglang', 'rollout.gpus_per_engine': min(2, gpus)}
    if preset == 'tiny':   # the frozen layout around a random tiny Qwen3: megatron, TP 2 when there are GPUs for it
        ov.update({'backend': 'megatron', 'model.dtype': 'bfloat16', 'batch.tp': 2 if gpus % 2 == 0 else 1,
                   'batch.distributed_optimizer': True, 'batch.recompute': 'selective', 'batch.sequence_parallel': gpus % 2 == 0})
    if path is not None: ov['model.name'] = path
    from memagent.backends.megatron import have_transformer_engine
    if not have_transformer_engine():   # sequence parallel needs Transformer Engine's layers; the local spec then
        ov.update({'batch.sequence_parallel': False, 'batch.attention': 'local'})
    return {'preset': preset, 'overrides': ov, 'world_size': gpus}


def tiny_megatron(recompute: str = 'selective', dtype: str = 'bfloat16'):
    "The tiny model in the frozen recipe's training precision on one GPU."
    from memagent.config import get_preset
    return get_preset('tiny', {'backend': 'megatron', 'model.dtype': dtype, 'batch.n_gpus': 1, 'batch.tp': 1,
                               'batch.distributed_optimizer': dtype == 'bfloat16', 'batch.recompute': recompute})


def config_for(preset: str, overrides: dict | None = None):
    from memagent.config import get_preset
    return tiny_megatron() if preset == 'tiny-megatron' else get_preset(preset, overrides or {})


def cmd_preset(a):
    import yaml
    from memagent.backends.megatron import have_transformer_engine
    if not have_transformer_engine(): print('# Transformer Engine is not installed: local attention spec, no sequence parallel')
    print(yaml.safe_dump(smoke_params(a.models, a.gpus), sort_keys=False).rstrip())


def cmd_plan(a):
    from memagent.plan import Cluster, make_plan
    cfg = config_for(a.preset, json.loads(a.overrides) if a.overrides else None)
    p = make_plan(cfg, Cluster(gpus_per_node=a.gpus_per_node, gpu_gb=a.gpu_gb))
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


def cmd_subset(a):
    "One GPU: the megatron step in bf16 with megatron-core's own (distributed) optimizer and each recompute mode, against fp32 torch."
    _need_cuda('subset')
    import torch
    from memagent.models import load_model
    from memagent.backends.torch import TorchBackend
    from memagent.backends.megatron import MegatronBackend, have_transformer_engine
    from memagent.plan import Cluster, make_plan
    out, gates = Path(a.out), []
    gpu_gb = torch.cuda.get_device_properties(0).total_memory / 2**30
    base = tiny_megatron()
    batch = _fixed_batch(load_model('tiny-qwen3', 'float32').config.vocab_size, base.batch.max_tokens_per_micro)
    ref = TorchBackend(load_model('tiny-qwen3', 'float32', 'cuda'), base.optim, base.optim.grad_clip)
    ref_loss, ref_norm = _step(ref, batch)
    ref_w = {k: v.float().cpu() for k, v in ref.hf_state_dict().items()}
    del ref; torch.cuda.empty_cache()
    for mode in ('none', 'selective', 'full'):
        cfg = tiny_megatron(mode)
        torch.cuda.reset_peak_memory_stats()
        be = MegatronBackend.from_config(cfg, load_model('tiny-qwen3', 'bfloat16'))
        try:
            loss, norm = _step(be, batch)
            peak = torch.cuda.max_memory_allocated()
            w = {k: v.float().cpu() for k, v in be.hf_state_dict().items()}
            dw = max(float((w[k] - ref_w[k]).abs().max()) for k in ref_w)
            state = be.state_dict()
            be.load_state_dict(be.hf_state_dict(), state)
            again = be.state_dict()
            same = json.dumps(state, default=str, sort_keys=True) == json.dumps(again, default=str, sort_keys=True)
        finally: be.close()
        plan = make_plan(cfg, Cluster(gpus_per_node=1, gpu_gb=gpu_gb))
        terms = ('weights', 'gradients', 'optimizer states', 'activations (saved)', 'activations (backward working set)', 'log-prob head chunk')
        planned = sum(plan.update.get(t, 0) for t in terms)
        gates.append({'recompute': mode, 'attention': be.attention, 'loss': loss, 'loss_fp32': ref_loss,
                      'loss_rel_diff': abs(loss - ref_loss) / abs(ref_loss), 'grad_norm': norm, 'grad_norm_fp32': ref_norm,
                      'grad_norm_rel_diff': abs(norm - ref_norm) / ref_norm, 'weights_max_abs_diff': dw,
                      'optimizer_state_round_trip': same, 'peak_bytes': peak, 'plan_bytes': planned, 'peak_over_plan': peak / planned,
                      'pass': abs(loss - ref_loss) / abs(ref_loss) < 2e-2 and abs(norm - ref_norm) / ref_norm < 5e-2 and same
                              and 0.5 < peak / planned < 1.25})
        print(json.dumps(gates[-1]))
    sync = weight_sync_check('cuda', 'bfloat16')
    print(json.dumps(sync))
    _write(out, 'subset.json', {'transformer_engine': have_transformer_engine(), 'device': torch.cuda.get_device_name(0),
                                'gpu_gb': gpu_gb, 'tolerances': {'loss_rel': 2e-2, 'grad_norm_rel': 5e-2, 'peak_over_plan': [0.5, 1.25]},
                                'sequence_parallel': 'not checked: it needs TP > 1, so at least 2 GPUs (part cluster)',
                                'checks': gates, 'weight_sync': sync})
    if not (all(g['pass'] for g in gates) and sync['pass']): sys.exit('gpu_check.py subset: a check failed (see subset.json)')


def _summary(r: dict) -> dict:
    "A weight check's numbers without its log-prob lists."
    return {k: v for k, v in r.items() if k not in ('trainer', 'engine')}


def weight_sync_check(device: str = 'cuda', dtype: str = 'bfloat16') -> dict:
    "The megatron policy's own log-probs of the fixed prompt against HF engines: before a step, after the step's sync (pass), and one that missed it (fail)."
    import torch
    from memagent.engines import HFEngine
    from memagent.models import load_model, load_tokenizer
    from memagent.backends.megatron import MegatronBackend, right_pad
    from memagent.runcheck import WEIGHT_PROMPT, WEIGHT_TOL, precision_key, weight_check, weight_prompt_ids
    key = precision_key(device.startswith('cuda'), dtype)
    tol, cfg = WEIGHT_TOL[key], tiny_megatron('selective', dtype)
    ids = weight_prompt_ids(load_tokenizer('tiny-qwen3'))
    be = MegatronBackend.from_config(cfg, load_model('tiny-qwen3', dtype))
    synced, missed = HFEngine(load_model('tiny-qwen3', dtype, device)), HFEngine(load_model('tiny-qwen3', dtype, device))

    def policy(ids):   # the policy's own forward: megatron's log-prob of each token after the first, given its prefix
        with torch.no_grad(): return be.logprobs(right_pad([ids]))[0, 1:].float().tolist()
    try:
        before, missed0 = weight_check(synced, policy, ids, tol), weight_check(missed, policy, ids, tol)
        _step(be, _fixed_batch(synced.vocab_size, cfg.batch.max_tokens_per_micro))
        synced.sync_weights(be.hf_state_dict(), None, None, None)
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
    from memagent.models import load_model, load_tokenizer, model_dir
    from memagent.data import make_synthetic
    from memagent.rollout import rollout
    from memagent.credit import trajectories_to_rows
    from memagent.transfer import InProcessChannel, RayChannel, layout_step
    from memagent.policy import make_group
    from memagent.runcheck import weight_prompt_ids
    p = yaml.safe_load(Path(a.params).read_text())
    cfg = get_preset(p['preset'], {**p['overrides'], 'rollout.colocate': False, 'rollout.engine': 'hf'})
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
        res['weight_check'] = sglang_sync_check(eng, wids, lp_base, lp_new, lambda: eng.sync_weights(new_sd, hf.model, tok, out / 'sync'))
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
    for backend in ('torch', 'megatron'):
        c = get_preset(p['preset'], {**p['overrides'], 'rollout.colocate': False, 'rollout.engine': 'hf', 'backend': backend,
                                     **({'batch.tp': 1, 'batch.sequence_parallel': False} if backend == 'torch' else {})})
        group = make_group(c, tok.pad_token_id, a.gpus)
        try:
            put, k = layout_step(rows, group.dp_size, c.optim.mini_batches)[0], [0]
            chan = InProcessChannel(len(put) + 1, 1) if a.gpus == 1 else RayChannel(len(put) + group.dp_size, group.dp_size)
            def once():
                k[0] += 1; chan.put(k[0], put); group.update(chan, k[0], c.rollout.request_timeout_s)
            res[f'{backend}_update_s'] = _time(once)
        finally: group.close()
    res['megatron_over_torch_time'] = res['megatron_update_s'] / res['torch_update_s']
    res['rows'] = len(rows)
    res['peak_vs_plan'] = peak_vs_plan(p, a.smoke_run, a.gpus)
    _write(out, 'compare.json', {'params': p, 'results': res})
    if not res['weight_check']['pass']: sys.exit('gpu_check.py compare: the SGLang weight check failed (see compare.json)')


def peak_vs_plan(p: dict, smoke_run: str | None, gpus: int) -> dict | None:
    "The smoke run's largest per-rank GPU peak during its updates (`gpu_peak_gib`) against the plan's update-phase terms torch allocates."
    from memagent.config import get_preset
    from memagent.plan import Cluster, GiB, make_plan
    if not smoke_run or not (Path(smoke_run) / 'metrics.jsonl').is_file(): return None
    import torch
    peaks = [json.loads(l).get('gpu_peak_gib') for l in open(Path(smoke_run) / 'metrics.jsonl')]
    peaks = [x for x in peaks if x is not None]
    if not peaks: return None
    plan = make_plan(get_preset(p['preset'], p['overrides']),
                     Cluster(gpus_per_node=gpus, gpu_gb=torch.cuda.get_device_properties(0).total_memory / GiB))
    allocated = ('weights', 'gradients', 'optimizer states', 'reference model', 'activations (saved)',
                 'activations (backward working set)', 'log-prob head chunk')
    planned = sum(plan.update.get(t, 0) for t in allocated) / GiB
    return {'measured_peak_gib': max(peaks), 'planned_gib': planned, 'measured_over_planned': max(peaks) / planned,
            'terms': list(allocated)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest='cmd', required=True)
    s = sub.add_parser('preset'); s.add_argument('--models', default='none'); s.add_argument('--gpus', type=int, default=8)
    s = sub.add_parser('plan'); s.add_argument('--preset', required=True); s.add_argument('--gpus-per-node', type=int, default=8)
    s.add_argument('--gpu-gb', type=float, default=80.0); s.add_argument('--overrides', default=None, help='JSON dict of dotted keys')
    s = sub.add_parser('subset'); s.add_argument('--out', required=True)
    s = sub.add_parser('compare'); s.add_argument('--params', required=True); s.add_argument('--gpus', type=int, required=True)
    s.add_argument('--out', required=True); s.add_argument('--smoke-run', default=None, help="the smoke's run directory (its metrics.jsonl)")
    a = ap.parse_args(argv)
    {'preset': cmd_preset, 'plan': cmd_plan, 'subset': cmd_subset, 'compare': cmd_compare}[a.cmd](a)


if __name__ == '__main__':
    main()
