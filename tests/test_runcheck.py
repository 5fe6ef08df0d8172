"""`Gates.phase` under a guard whose signal lands between the phase's expiry check and the phase's
start: the one window the notebook's examples cannot hit on purpose."""

from memagent.runcheck import Gates, RunTimeout


class _LateGuard:
    """A guard that reads as not expired at the phase's first check and expired from then on, as
    when SIGALRM arrives between the two reads."""

    current, fired_in, reads = None, '', 0

    @property
    def expired(self):
        self.reads += 1
        return self.reads > 1

    def timeout(self):
        return RunTimeout(f"wall-clock guard: exceeded during phase {self.current!r}")


def test_guard_firing_as_a_phase_begins_fails_that_phase_and_runs_no_body():
    g, ran = _LateGuard(), []
    G = Gates(g, echo=False, stop_on_failure=True)
    with G.phase('train') as go:
        if go:
            ran.append('train')
    with G.phase('shutdown', always=True) as go:
        if go:
            ran.append('shutdown')
    assert ran == ['shutdown'] and g.current is None
    assert G.failed == ['train'] and G.stopped == 'train'
    assert G.rows[0]['error'] == "RunTimeout: wall-clock guard: exceeded during phase 'train'"
