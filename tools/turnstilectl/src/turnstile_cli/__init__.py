"""turnstilectl: the command line internal users reach for, and the local stack runner."""
