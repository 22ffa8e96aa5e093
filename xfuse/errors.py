"""``ConfigError``, in a leaf module: the config, the planners and the CLI import it without import cycles."""


class ConfigError(ValueError):
    """A configuration value is wrong. The message starts with the dotted key, e.g. ``parallel.num_patches: ...``."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"{key}: {message}")
