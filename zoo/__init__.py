"""zoo: a weight-space model zoo database and retrieval service."""

__version__ = "0.1.0"
