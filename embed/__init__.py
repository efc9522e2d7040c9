"""Adapters as vectors and predictions: the Weight2Token model and its training, method choice and calibration, the
FAISS indexes, the query engine and the zoo map."""
