"""Placeholder so ``-p turnstile_testing.plugin`` loads; main replaces it on merge."""
