"""The root of every error the project reports to a user.

The CLI prints an AgentEnvError as one line and exits non-zero, without a traceback; any other
exception is a bug and keeps its traceback.
"""


class AgentEnvError(Exception):
    """An error with a message fit to show to a user as it is."""
