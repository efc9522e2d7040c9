"""Serving: a space's vectors and files written, its FAISS indexes, the query engine, the zoo map and the query resources."""
