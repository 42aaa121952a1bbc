"""Per-method authorization (SPEC Z2): a policy file, a per-method table of whom a
call acts for, and the check of both that runs before a handler (:mod:`.authorizer`)."""
