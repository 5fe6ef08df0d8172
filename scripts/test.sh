#!/usr/bin/env bash
# The test command: every notebook's worked examples, then the pytest suite, on TEST_WORKERS processes (default 2).
# Notebooks that start Ray run one at a time, beside the others; pytest keeps its Ray and notebook tests on one worker
# (tests/conftest.py) and prints its slowest tests.
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
n=${TEST_WORKERS:-2}
ray_nbs=$(grep -l 'ensure_ray(' nbs/*.ipynb | xargs -n1 basename | sed 's/\.ipynb$//' | paste -sd'|')
# The notebooks that start Ray run one at a time, beside the others (which start no Ray); each part logs to its own
# file, printed when both are done.
logs=$(mktemp -d)
echo "+ nbdev_test --n_workers 1 --timing --file_re '^($ray_nbs)\.ipynb\$'    (the notebooks that start Ray, one at a time; in the background)"
nbdev_test --n_workers 1 --timing --file_re "^($ray_nbs)\.ipynb\$" >"$logs/ray-notebooks.log" 2>&1 & ray_pid=$!
echo "+ nbdev_test --n_workers $n --timing --skip_file_re '^[_.]|^($ray_nbs)\.ipynb\$'"
nb_rc=0; nbdev_test --n_workers "$n" --timing --skip_file_re "^[_.]|^($ray_nbs)\.ipynb\$" || nb_rc=$?
ray_rc=0; wait $ray_pid || ray_rc=$?
echo "+ (the notebooks that start Ray:)"; cat "$logs/ray-notebooks.log"; rm -rf "$logs"
[ $nb_rc -eq 0 ] && [ $ray_rc -eq 0 ] || { echo "FAIL: nbdev_test"; exit 1; }
# pytest in two parts. First every test but the exclusive ones on $n workers: the Ray and notebook tests on one worker,
# one after another, the rest spread over both (tests/conftest.py). Then the exclusive tests (four or more Ray ranks each),
# one at a time beside nothing: run next to another test they would slow both several times over on a 2-core machine.
echo "+ pytest -q -ra -n $n --dist loadgroup --durations=25 -m 'not exclusive' tests"
pytest -q -ra -n "$n" --dist loadgroup --durations=25 -m 'not exclusive' tests; rc=$?
# pytest exits 5 when it collected no test: that is a failure of the suite, not a pass.
[ $rc -eq 5 ] && echo "FAIL: pytest collected no tests"
# Only the files that mark a test exclusive are collected for it (collecting every file imports the whole suite again).
excl=$(grep -l 'mark\.exclusive' tests/test_*.py | paste -sd' ')
echo "+ pytest -q -ra -n 0 --durations=0 -m exclusive $excl    (one at a time, beside nothing)"
pytest -q -ra -n 0 --durations=0 -m exclusive $excl; rc2=$?
[ $rc2 -eq 5 ] && echo "FAIL: pytest collected no exclusive tests"
[ $rc -ne 0 ] && exit $rc
exit $rc2
