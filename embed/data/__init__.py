"""An embedding space's adapters as data: plain types, loaded from the database and the blob store, and as W2T's token tensors."""
