"""AgentENV: one VM per agent trajectory, served through the E2B API."""

__version__ = "0.1.0"
