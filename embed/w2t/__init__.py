"""The Weight2Token model: the network and its heads, its checkpoint directory, and a trained ensemble as the runtime model."""
