"""``ConfigError``, in a leaf module: the config, the planners and the CLI import it without import cycles."""


class ConfigError(ValueError):
    """A configuration value is wrong. The message starts with the dotted key, e.g. ``parallel.num_patches: ...``.

    ``reported``: the raiser already wrote it to stderr on this rank (the start-up network probe does, before any
    rank leaves, since torchrun terminates a node's other ranks as soon as one exits); the CLI then does not repeat it.
    """

    reported = False

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"{key}: {message}")
