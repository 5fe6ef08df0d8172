"""Shared pytest configuration: the `gpu` marker (skipped unless CUDA and SGLang are available), and
the groups that keep
the tests which start Ray or run a notebook one at a time when the suite runs in parallel."""

import importlib.util, inspect, os, re, sys
from pathlib import Path
import pytest

# the repository root, so `pytest` finds the package without an install
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
# one thread per process: under pytest-xdist each worker is one of the machine's cores, and the Ray
# ranks and notebook kernels these tests start inherit it
os.environ.setdefault('OMP_NUM_THREADS', '1')

# A test is in the group `ray_or_notebook` when its own source, a fixture it uses or its parameters
# start Ray (through the project's `ensure_ray`, a Ray channel or group, a placement, the simulated
# node, two or more ranks) or run a notebook through papermill. With `-n 2 --dist loadgroup`
# (scripts/test.sh) every test of the group runs on one worker, one after the other, so no two Ray
# clusters or notebook kernels run at once; the other worker takes the rest. `check_ray_grouping`
# below fails a test outside the group that starts Ray in its own process.
GROUP = 'ray_or_notebook'
TESTS = Path(__file__).resolve().parent
HEAVY = re.compile(
    r"papermill|execute_notebook|ensure_ray|RayChannel|RayGroup|SimulatedNode|launch_servers|Placement\b|world_size=[2-9]|world_size=world|ray\.init|'ray'"
)


def _gpu_ready() -> bool:
    try:
        import torch

        return torch.cuda.is_available() and importlib.util.find_spec('sglang') is not None
    except Exception:
        return False


def _source(obj) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ''


def heavy(item) -> bool:
    """Does this test start Ray or run a notebook (by its source, its fixtures' sources or its
    parameters)?"""
    texts = [_source(getattr(item, 'function', None))]
    info = getattr(item, '_fixtureinfo', None)
    for name in info.names_closure if info else ():
        for fd in info.name2fixturedefs.get(name, ()):
            try:
                here = (
                    Path(inspect.getfile(fd.func)).resolve().parent == TESTS
                    and fd.func.__module__ != __name__
                )
            except TypeError:
                here = False
            if here:
                texts.append(_source(fd.func))  # the suite's own fixtures, not pytest's
    cs = getattr(item, 'callspec', None)
    if cs is not None:
        texts.append(repr(cs.params) + ' ' + cs.id)
    return any(HEAVY.search(t) for t in texts)


def pytest_configure(config):
    config.addinivalue_line('markers', 'gpu: needs a CUDA device and SGLang; skipped otherwise')
    config.addinivalue_line('markers', 'slow: slow test')
    config.addinivalue_line(
        'markers',
        "exclusive: starts four or more Ray ranks, enough to load every core of a CI machine; "
        "scripts/test.sh runs these after the others, one at a time and beside nothing",
    )


@pytest.hookimpl(
    tryfirst=True
)  # before pytest-xdist's own hook, which reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    for item in items:
        if heavy(item):
            item.add_marker(pytest.mark.xdist_group(GROUP))
            item.user_properties.append(('group', GROUP))
    if _gpu_ready():
        return
    skip = pytest.mark.skip(reason='needs a CUDA device and SGLang')
    for item in items:
        if 'gpu' in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def check_ray_grouping(request):
    """A test outside the group that starts Ray in this process fails, naming itself: the grouping
    stays true."""
    # Under `--dist loadgroup` pytest-xdist appends `@group` to a grouped test's id and schedules by
    # it; a grouped test without it means the grouping silently did not take effect (pytest-xdist
    # 3.8 cannot rename the node ids of some pytest 9 builds) and Ray tests would run side by side:
    # each such test fails, naming the versions.
    if (
        getattr(request.config.option, 'loadgroup', False)
        and any(True for _ in request.node.iter_markers('xdist_group'))
        and '@' not in request.node.nodeid
    ):
        import xdist

        pytest.fail(
            f"--dist loadgroup did not group {request.node.nodeid} under pytest "
            f"{pytest.__version__} and pytest-xdist "
            f"{xdist.__version__}: install the versions settings.ini names (pytest>=8.4,<9)",
            pytrace=False,
        )
    before = 'ray' in sys.modules and sys.modules['ray'].is_initialized()
    yield
    if before or ('group', GROUP) in request.node.user_properties:
        return
    if 'ray' in sys.modules and sys.modules['ray'].is_initialized():
        pytest.fail(
            f"{request.node.nodeid} started Ray but is not in the {GROUP!r} group: name what "
            "starts it in its source "
            f"(tests/conftest.py, HEAVY) so that it never runs beside another Ray test"
        )
