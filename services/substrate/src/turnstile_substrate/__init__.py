"""The substrate service: make a sandbox's runtime exist and record who it is
charged to (SPEC S1–S7, A1–A5)."""
