"""Storage: typed models, sessions, locks, the repository (the one label write), the catalog, blobs, jobs, lineage
and API tokens."""
