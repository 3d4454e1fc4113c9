"""Exception types. Every message names the thing at fault, what was wrong and how to fix it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class FSDPBuilderError(Exception):
    """Base class of every error this library raises on purpose."""


class ConfigurationError(FSDPBuilderError, ValueError):
    """A builder call, strategy or model does not fit together; raised before any collective."""


class PlanError(ConfigurationError):
    """The model cannot be split into wrap units as asked (e.g. tied weights split across units)."""


class MaterializationError(FSDPBuilderError, RuntimeError):
    """A module could not be given real storage and values."""


class StateMismatchError(FSDPBuilderError, RuntimeError):
    """Ranks hold different values where they must hold the same ones."""


class RankDisagreementError(FSDPBuilderError, RuntimeError):
    """At least one rank failed a step, or ranks built different models; raised on every rank.
    ``failures`` maps each failing rank to its message."""

    def __init__(self, stage: str, failures: dict[int, str], unit: str | None = None) -> None:
        self.stage = stage
        self.unit = unit
        self.failures = dict(failures)
        where = f"stage '{stage}'" + (f" of unit '{unit}'" if unit is not None else "")
        ranks = ", ".join(str(r) for r in sorted(failures))
        lines = [f"{where} failed on rank(s) {ranks}; every rank stops here instead of hanging."]
        lines += [f"  rank {r}: {msg}" for r, msg in sorted(failures.items())]
        super().__init__("\n".join(lines))


class CommunicationError(FSDPBuilderError, RuntimeError):
    """A collective of the build failed or timed out (a peer died, hangs or never arrived);
    raised on every surviving rank. ``missing_ranks``: those that did not arrive, where known."""

    def __init__(
        self,
        stage: str,
        unit: str | None,
        missing_ranks: list[int],
        detail: str,
        timeout: float | None,
    ) -> None:
        self.stage = stage
        self.unit = unit
        self.missing_ranks = list(missing_ranks)
        where = f"stage '{stage}'" + (f" of unit '{unit}'" if unit is not None else "")
        who = (
            f"rank(s) {', '.join(map(str, missing_ranks))} did not arrive"
            if missing_ranks
            else "a peer did not complete it"
        )
        bound = (
            f"the build's timeout of {timeout:g} s"
            if timeout is not None
            else "the process group's timeout"
        )
        super().__init__(
            f"A collective of {where} failed: {who} ({detail}). If a peer is only slow, raise "
            f"{bound} with builder.timeout(seconds); if it died, its own log says why."
        )


def config_error(where: str, argument: str, problem: str, fix: str) -> ConfigurationError:
    """Build a ConfigurationError that reads `where(argument=...)`: problem. fix."""
    return ConfigurationError(f"`{where}` got an invalid `{argument}`: {problem}. {fix}")


def require_bool(value: Any, where: str, argument: str) -> None:
    """Refuse anything but True or False (``1`` included), naming ``where`` and ``argument``."""
    if not isinstance(value, bool):
        raise config_error(
            where, argument, f"expected a bool, got {value!r}", "Pass True or False."
        )


class ExportError(FSDPBuilderError, RuntimeError):
    """Writing a checkpoint failed; raised on every rank alike, with the OS's or torch's error
    as ``__cause__``; what the export had written is removed."""


Validator = Callable[[Any, Any, Any], None]


def checked(validator: Validator, expected: str, fix: str) -> Validator:
    """``validator`` (e.g. ``instance_of(bool)``) with its TypeError or ValueError, whose
    message is unreadable, turned into a ConfigurationError naming ``expected`` and ``fix``."""

    def check(instance: Any, attribute: Any, value: Any) -> None:
        try:
            validator(instance, attribute, value)
        except FSDPBuilderError:
            raise
        except (TypeError, ValueError) as exc:
            raise config_error(
                type(instance).__name__,
                attribute.name,
                f"expected {expected}, got {type(value).__name__} {value!r}",
                fix,
            ) from exc

    return check
