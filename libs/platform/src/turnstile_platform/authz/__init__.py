"""Per-method authorization (SPEC Z2): a policy file, a per-method table of whom a
call acts for, and the server interceptor that checks both before a handler runs."""
