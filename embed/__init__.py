"""Weight2Token embedder, FAISS index and predictors (built in a later issue)."""
