"The functions a reader calls document every parameter with docments (a comment after each one)."

import inspect
from fastcore.docments import docments


def test_the_functions_a_reader_calls_document_every_parameter():
    from memagent.rollout import rollout
    from memagent.credit import expand_rows
    from memagent.loss import policy_loss
    from memagent.evaluate import evaluate
    from memagent.acceptance.gate import compare
    from memagent.acceptance.report import render_acceptance, verify_acceptance
    from memagent.trainer import Trainer

    missing = {}
    functions = (
        rollout,
        expand_rows,
        policy_loss,
        evaluate,
        compare,
        render_acceptance,
        verify_acceptance,
        Trainer.__init__,
    )
    for f in functions:
        docs = docments(f)
        params = [p for p in inspect.signature(f).parameters if p != 'self']
        undocumented = [p for p in params if not (docs.get(p) or '').strip()]
        if undocumented:
            missing[f.__qualname__] = undocumented
    assert not missing, f"parameters without a docment: {missing}"
