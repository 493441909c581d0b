"""Op families. Each module has a plain PyTorch reference (the oracle, runs on CPU); GPU kernels slot in
behind the same call. Decode-sized calls (row_invariant=True) compute every row with a reduction order
that does not depend on how many rows share the call (DESIGN.md C1)."""
