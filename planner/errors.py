"""Errors that the planner reports to users as one line each, naming the offending field."""

from collections.abc import Iterable


class SpecError(ValueError):
    """A problem in user input (plan, cluster file, model spec, CLI flag).

    `problems` holds one line per problem; str() joins them. The CLI prints these lines to stderr
    and exits with code 2, without a traceback.
    """

    def __init__(self, problems: str | Iterable[str]) -> None:
        if isinstance(problems, str):
            problems = [problems]
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class PlanError(SpecError):
    """A plan that breaks a rule of the plan format."""


class ClusterError(SpecError):
    """A cluster spec that cannot be parsed or is inconsistent."""


class ModelSpecError(SpecError):
    """A model spec that cannot be parsed or is inconsistent."""
