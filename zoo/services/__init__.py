"""Services: the pipelines the command line, the runners and the web app share (ingest, check, export)."""
