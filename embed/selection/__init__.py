"""Methods chosen out of fold: the choice rule, its candidates (the few-label channel metrics among them), calibration and metrics."""
