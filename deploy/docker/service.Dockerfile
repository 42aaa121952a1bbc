# One Dockerfile for every Turnstile image. Each image holds one workspace member
# (SERVICE: admission | substrate | affinity) with the libraries it depends on,
# installed from uv.lock into /app/.venv, and runs one of that member's console
# scripts (COMMAND, default turnstile-$SERVICE). The worker is the affinity
# member's turnstile-worker script, so it is built from this file too:
#
#   docker build -f deploy/docker/service.Dockerfile --build-arg SERVICE=admission \
#     -t turnstile-admission .
#   docker build -f deploy/docker/service.Dockerfile --build-arg SERVICE=affinity \
#     --build-arg COMMAND=turnstile-worker -t turnstile-worker .
#
# Targets: `runtime` (the default, last stage) is the production image: code and
# venv owned by root, so the non-root process cannot change them. `dev` is the
# same image with /app owned by the runtime user, so Tilt's live_update can sync
# source into it and touch its restart file.

ARG PYTHON_IMAGE=python:3.11.14-slim-trixie

FROM ghcr.io/astral-sh/uv:0.13.9 AS uv

# ---------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS builder
ARG SERVICE
ARG COMMAND=turnstile-${SERVICE}

# Use the base image's interpreter (the runtime stage has the same one at the same
# path), compile bytecode once at build time, copy rather than hard-link from the
# cache mount.
ENV UV_PYTHON_DOWNLOADS=never \
    UV_PYTHON=/usr/local/bin/python3.11 \
    UV_COMPILE_BYTECODE=1 \
    UV_LINK_MODE=copy \
    UV_PROJECT_ENVIRONMENT=/app/.venv

COPY --from=uv /uv /usr/local/bin/uv
WORKDIR /app

# Third-party dependencies first: this layer changes only when the lock or a
# member's manifest changes, not on every source edit. uv needs every member's
# pyproject.toml to read the workspace, not their sources.
COPY pyproject.toml uv.lock ./
COPY libs/contracts/pyproject.toml libs/contracts/pyproject.toml
COPY libs/platform/pyproject.toml libs/platform/pyproject.toml
COPY libs/clientkeys/pyproject.toml libs/clientkeys/pyproject.toml
COPY libs/client/pyproject.toml libs/client/pyproject.toml
COPY libs/testing/pyproject.toml libs/testing/pyproject.toml
COPY services/admission/pyproject.toml services/admission/pyproject.toml
COPY services/substrate/pyproject.toml services/substrate/pyproject.toml
COPY services/affinity/pyproject.toml services/affinity/pyproject.toml
RUN --mount=type=cache,target=/root/.cache/uv \
    test -n "${SERVICE}" \
    && uv sync --frozen --no-dev --no-install-workspace --package "turnstile-${SERVICE}"

# Then the sources of the libraries every service uses and of this service only
# (src/ trees: no tests, no libs/testing).
COPY libs/contracts/src libs/contracts/src
COPY libs/platform/src libs/platform/src
COPY libs/clientkeys/src libs/clientkeys/src
COPY services/${SERVICE}/src services/${SERVICE}/src
# Workspace members are installed editable (paths into /app/libs and
# /app/services), so the runtime stage needs the same tree at the same path, and
# Tilt's live_update can sync source files without reinstalling anything.
RUN --mount=type=cache,target=/root/.cache/uv \
    uv sync --frozen --no-dev --package "turnstile-${SERVICE}" \
    && test -x "/app/.venv/bin/${COMMAND}" \
    && ln -s "${COMMAND}" /app/.venv/bin/turnstile-entrypoint

# ---------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS base
# A fixed numeric id, so Kubernetes can check runAsNonRoot without reading
# /etc/passwd, and manifests can name it (runAsUser: 10001).
RUN groupadd --system --gid 10001 turnstile \
    && useradd --system --uid 10001 --gid turnstile --no-create-home \
       --home-dir /nonexistent --shell /usr/sbin/nologin turnstile
ENV PATH=/app/.venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    TURNSTILE_HOST=0.0.0.0 \
    TURNSTILE_LOG_FORMAT=json
WORKDIR /app
# Kubernetes sets the ports per service; EXPOSE documents the defaults of all three.
EXPOSE 50051 50052 50053 9091 9092 9093
CMD ["turnstile-entrypoint"]

# ---------------------------------------------------------------------------
FROM base AS dev
COPY --from=builder --chown=10001:10001 /app /app
RUN chown 10001:10001 /app
USER 10001:10001

# ---------------------------------------------------------------------------
FROM base AS runtime
COPY --from=builder /app /app
USER 10001:10001
