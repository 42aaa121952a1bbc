"""Offline checks of what deploys Turnstile: the Tiltfile, the Kubernetes manifests
and the Dockerfiles. No Docker engine, cluster or Tilt binary is needed."""
