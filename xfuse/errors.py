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


class RequestCancelled(RuntimeError):
    """A pipeline call stopped between two denoising steps because global rank 0's ``cancel_if`` condition held
    (``xfuse serve``: the request's client went away); raised on every rank alike, the world stays healthy."""

    def __init__(self, stopped_at: int, num_steps: int):
        self.stopped_at, self.num_steps = stopped_at, num_steps
        super().__init__(
            f"the request was cancelled before step {stopped_at} of {num_steps} (rank 0's cancel_if condition held); "
            f"every rank ran steps 0-{stopped_at - 1} and stopped"
        )
