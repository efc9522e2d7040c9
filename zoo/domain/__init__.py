"""The pure math and types: canonical form, probes and sketches, spectra, fingerprints, module names, similarity.

Torch and numpy only: nothing here imports the database, the file formats, `embed`, the web app, Flask or
SQLAlchemy, and nothing here does I/O (an import contract checks it: tests/test_layers.py).
"""
