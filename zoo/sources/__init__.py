"""Where adapters come from. Sources yield paths to read; they never parse them."""
