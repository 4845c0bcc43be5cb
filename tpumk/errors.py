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


class VMEMError(PlanError):
    """A plan that does not fit the target's VMEM (the knobs that trade VMEM can be lowered)."""


class CompileError(TpumkError):
    """The TPU compiler rejected a build the plan accepted (the message is the compiler's line
    that says why, e.g. RESOURCE_EXHAUSTED for scoped VMEM)."""


class ServingConfigError(TpumkError):
    """A vLLM configuration the tpumk plugin cannot serve (one line: the setting, what was expected)."""


class ArtifactError(TpumkError):
    """An exported artifact is missing, altered, or was built for another stack or target."""


class PositionError(TpumkError):
    """A decode step's positions or cache lengths break the positions contract
    (`tpumk.model.positions`)."""


class TokenError(TpumkError):
    """A decode step's token ids are outside the model's vocabulary."""


class NonFiniteError(TpumkError):
    """A decode step produced NaN or infinite logits (e.g. a NaN weight or an absurd rope_theta)."""


class SignatureError(ArtifactError):
    """An artifact is unsigned while a signing key is configured, signed with another key, or its
    signature does not match its manifest."""


class SigningKeyError(ArtifactError):
    """The signing key configuration (TPUMK_SIGNING_KEY / TPUMK_SIGNING_KEY_FILE) is unusable."""


class ArtifactPathError(ArtifactError):
    """An artifact path would leave --out (unsafe model or target name), or --out is unusable."""


def one_line(e: BaseException) -> str:
    """An exception's text on one line (library messages span lines; tpumk's errors are one)."""
    return " ".join(str(e).split())


def and_more(names: list) -> str:
    """" (and N more)" after the first of `names` an error quotes; empty for one name."""
    return f" (and {len(names) - 1} more)" if len(names) > 1 else ""


def count_of(n: int, noun: str, plural: str | None = None) -> str:
    """'1 trial', '2 trials', '1,024 configurations': a count with its noun in the right number."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"


def did_you_mean(name: str, names: list[str]) -> str:
    """' (did you mean 'x'?)' for the closest of `names` to `name` (case-insensitive), '' when none
    is close: for an unknown preset or target name."""
    import difflib

    close = difflib.get_close_matches(name.lower(), names, n=1, cutoff=0.7) if isinstance(name, str) else []
    return f" (did you mean '{close[0]}'?)" if close else ""
