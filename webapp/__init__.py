"""Flask web app (built in a later issue)."""
