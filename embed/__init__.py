"""Adapters as vectors and predictions, in subpackages by job:

- `training`: W2T's training (`zoo train`, `zoo quickstart`) and `zoo eval`;
- `serving`: a space's vectors and derived files, the FAISS indexes, the module store, the query engine, the zoo map,
  search by meaning and the resources the CLI, the REST API and the pages show;
- what both use: `w2t` (the Weight2Token model, its checkpoint and the runtime ensemble), `data` (a space's adapters in
  memory and as token tensors) and `selection` (methods chosen out of fold, calibrated, and the metrics they are
  judged by).

Serving never imports training, and the shared packages import neither (pyproject.toml's import contracts).
"""
