"""Reference zoos: real LoRA adapters trained here, with the attributes that made them and the
performance they measurably reach (ground truth for prediction, retrieval and the demo)."""
