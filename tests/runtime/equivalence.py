"""The one-rank reference run and the comparison every equivalence test makes against it
(losses, grad norms, final parameters, relative to 1e-5)."""

from harness import run_distributed
from runtime.plans import REFERENCE, write_plan
from runtime.workers import max_relative_difference, train_with_first_grads

TOLERANCE = 1e-5
_references = {}


def reference(tmp_path_factory, model):
    if model not in _references:
        path = write_plan(tmp_path_factory.mktemp("ref"), "one-rank", model, 1, REFERENCE)
        _references[model] = run_distributed(train_with_first_grads, 1, path, timeout=240)[0]
    return _references[model]


def compare(result, ref):
    """Largest relative differences: (losses, grad norms, parameters)."""
    loss = max(max_relative_difference(a, b) for a, b in zip(result["losses"], ref["losses"]))
    norm = max(
        max_relative_difference(a, b) for a, b in zip(result["grad_norms"], ref["grad_norms"])
    )
    assert result["params"].keys() == ref["params"].keys()
    param = max(
        max_relative_difference(result["params"][k], ref["params"][k]) for k in ref["params"]
    )
    return loss, norm, param
