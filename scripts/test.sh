#!/usr/bin/env bash
# The test command: every notebook's worked examples, then the pytest suite.
set -uo pipefail
cd "$(dirname "$0")/.."
echo "+ nbdev_test --n_workers 1 --do_print"
nbdev_test --n_workers 1 --do_print || { echo "FAIL: nbdev_test"; exit 1; }
echo "+ pytest -q -ra tests"
pytest -q -ra tests; rc=$?
# pytest exits 5 when it collected no test: that is a failure of the suite, not a pass.
[ $rc -eq 5 ] && echo "FAIL: pytest collected no tests"
exit $rc
