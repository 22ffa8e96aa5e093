"""The errors xfuse raises to its callers, in a leaf module: the config, the planners, the runtime and the CLI import
it without import cycles."""


class ConfigError(ValueError):
    """A configuration value is wrong. The message starts with the dotted key, e.g. ``parallel.num_patches: ...``.

    ``reported``: the raiser already wrote it to stderr on this rank (the start-up network probe does, before any
    rank leaves, since torchrun terminates a node's other ranks as soon as one exits); the CLI then does not repeat it.
    """

    reported = False

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"{key}: {message}")


class StartupMismatch(ValueError):
    """Ranks disagree on something they must share (config, versions, model, plan)."""


class WorldFailure(RuntimeError):
    """This rank stopped because a rank of the world failed; the message names the first failure."""


class CompileTimeout(RuntimeError):
    """A rank spent longer than ``compile.timeout_s`` compiling one request shape; the world stops, naming it."""
