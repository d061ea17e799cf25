"""Errors a user can act on: the CLI prints them as one line and exits with code 2."""


class SlipstreamError(Exception):
    """A problem with the user's input (model file, prompt, parameters), not a bug."""


class ModelLoadError(SlipstreamError):
    pass


class PromptTooLongError(SlipstreamError):
    pass


class QueueFullError(SlipstreamError):
    """The engine's waiting queue is full: the caller should retry later (HTTP 503)."""


class ConfigError(SlipstreamError, ValueError):
    """An invalid engine or server setting (one type wherever a setting is checked)."""
