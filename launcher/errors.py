"""Exception root of the driver."""


class LaunchError(Exception):
    """The job cannot start or go on; the message is the one-line reason shown to the user."""


class ConfigError(LaunchError):
    """A command-line value or host specification is invalid."""


class DiscoveryError(LaunchError):
    """The host discovery script failed or printed something that is not ``host[:slots]``."""


class StartError(ConfigError):
    """A worker process cannot be started on this machine: its command (or ssh) cannot be run."""
