"The training path carries no test fakes or benchmark code, and the trainer stays a short loop."
import ast, subprocess, sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / 'memagent'
TRAINING_PATH = ('trainer', 'doctor', 'colocate', 'policy', 'rollout', 'transfer', 'loss', 'credit', 'engines', 'checkpoint', 'backends.torch',
                 'backends.ray', 'backends.megatron', 'reward', 'prompts', 'chunking', 'models', 'data', 'config', 'provenance')


def test_training_path_does_not_import_testing_bench_or_the_simulated_node():
    code = ("import sys\n" + ''.join(f"import memagent.{m}\n" for m in TRAINING_PATH) +
            "bad = sorted(m for m in sys.modules if m in ('memagent.testing', 'memagent.bench', 'memagent.simnode'))\nprint(bad)")
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == '[]', out.stdout


def test_training_path_defines_no_fakes_or_benchmarks():
    for m in TRAINING_PATH:
        tree = ast.parse((PKG / (m.replace('.', '/') + '.py')).read_text())
        names = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
        bad = [n for n in names if n.lstrip('_').lower().startswith(('fake', 'bench', 'synthetic_run', 'counting'))]
        assert not bad, f"memagent/{m}: {bad} belong in memagent.testing or memagent.bench"


def test_trainer_is_a_short_loop():
    src = (PKG / 'trainer.py').read_text()
    assert len(src.splitlines()) < 300, 'run health, resume, colocation and deadlines live in their own modules'
    concrete = [n for n in ('TorchBackend', 'MegatronBackend', 'RayGroup', 'LocalGroup', 'HFEngine', 'SGLangEngine', 'cfg.backend')
                if n in src]
    assert not concrete, f'the trainer talks to a policy group and an engine, not to {concrete}'
