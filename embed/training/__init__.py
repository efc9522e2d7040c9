"""Training W2T (`zoo train`, `zoo quickstart`) and evaluating every method on held-out splits (`zoo eval`)."""
