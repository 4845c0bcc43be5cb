"""Errors tpumk raises for bad input. The CLI prints them as one line and exits non-zero."""


class TpumkError(Exception):
    """Base class: a user-facing error whose message is one line naming what is wrong."""


class ConfigError(TpumkError):
    """A model config, tuning config or space file is malformed or inconsistent."""


class NotSupportedError(TpumkError):
    """A valid architecture that tpumk does not implement yet ("not supported yet: <feature>")."""


class TargetError(TpumkError):
    """An unknown target, or a target that does not match the attached devices."""


class CheckpointError(TpumkError):
    """A checkpoint directory is missing files or holds tensors of unexpected names or shapes."""


class PlanError(TpumkError):
    """A tuning configuration the plan rejects before compiling (e.g. it does not fit VMEM)."""


class ArtifactError(TpumkError):
    """An exported artifact is missing, altered, or was built for another stack or target."""
