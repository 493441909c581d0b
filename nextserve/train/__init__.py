"""Training for Flash-Next: a vectorised, differentiable forward of the very model nextserve serves
(parameters named with nextserve's runtime names), stdlib data, and the default-model training script."""
