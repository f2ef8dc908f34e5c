"""Error types shared by the runtime and the CLI.

Every error a user can cause (bad config, bad model config, bad artifact manifest, bad image
label) is a ``MonodecodeError``; its message is one line that names the problem. The CLI prints
that line and exits non-zero instead of a traceback.
"""


class MonodecodeError(ValueError):
    """Base class for user-facing errors: the message is one complete line."""


class ModelConfigError(MonodecodeError):
    """A Hugging Face ``config.json`` we cannot serve (unsupported architecture, bad field)."""


class ConfigError(MonodecodeError):
    """A bad ``monodecode`` option (unknown key, wrong type, value out of range)."""


class ArtifactError(MonodecodeError):
    """A missing, malformed or tampered kernel artifact or manifest."""


class RefusalError(MonodecodeError):
    """Mono decode cannot run this deployment. ``reasons`` holds every reason, each
    ``"<code>: <sentence>"`` with a snake_case code (e.g. ``no_artifact``) used as a metric label."""

    def __init__(self, reasons: list[str] | str):
        self.reasons = [reasons] if isinstance(reasons, str) else list(reasons)
        super().__init__("mono decode refused: " + "; ".join(self.reasons))

    def __reduce__(self):  # pickles with its reasons (vLLM sends startup errors between processes)
        return (type(self), (self.reasons,))

    @property
    def codes(self) -> list[str]:
        return [r.split(":", 1)[0].strip() for r in self.reasons]


def exception_line(e: BaseException, limit: int | None = None) -> str:
    """``"TypeName: first line of the message"`` (the first line cut to ``limit`` characters): how
    an unexpected exception is named in a one-line reason, note or log line."""
    first = (str(e).splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:limit]}"
