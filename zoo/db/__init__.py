"""Storage: typed models, engine/session setup, repository functions."""
