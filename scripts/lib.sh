# Shared by the scripts: find or install what Turnstile needs on this machine.
# Sourced, not run. Every function is idempotent.

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RUN_DIR="$ROOT/.run"
REDIS_URL="${TURNSTILE_REDIS_URL:-redis://127.0.0.1:6379/0}"
DATABASE_URL="${TURNSTILE_DATABASE_URL:-postgresql://postgres@127.0.0.1:5432/postgres}"

# On stderr; should its reader be gone (`./scripts/up | tee log` and Ctrl-C, which kills
# tee too), on the terminal instead, where the person who pressed Ctrl-C looks.
say() {
  printf '\033[1m==> %s\033[0m\n' "$*" >&2 2>/dev/null \
    || { printf '==> %s\n' "$*" >/dev/tty; } 2>/dev/null || true
}

as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
    echo "need root for: $*" >&2; return 1; fi
}

apt_install() {
  say "installing $* (Debian packages)"
  if [ -z "${APT_UPDATED:-}" ]; then as_root apt-get update -qq; APT_UPDATED=1; fi
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

ensure_uv() {
  if command -v uv >/dev/null; then return; fi
  export PATH="$HOME/.local/bin:$PATH"
  if ! command -v uv >/dev/null; then
    say "installing uv from PyPI"
    python3 -m pip install --quiet --user uv 2>/dev/null || python3 -m pip install --quiet uv \
      || python3 -m pip install --quiet --break-system-packages uv
    hash -r
  fi
  # uv is in ~/.local/bin, which a new terminal does not put on PATH: say so once.
  if [ -x "$HOME/.local/bin/uv" ]; then
    say "uv is in ~/.local/bin, not on your PATH: in another terminal run"
    say "  export PATH=\"\$HOME/.local/bin:\$PATH\"   (or use .venv/bin/turnstilectl directly)"
  fi
}

# host and port of a redis:// or postgresql:// URL
url_host() { python3 -c 'import sys,urllib.parse as u; print(u.urlsplit(sys.argv[1]).hostname or "127.0.0.1")' "$1"; }
url_port() { python3 -c 'import sys,urllib.parse as u; print(u.urlsplit(sys.argv[1]).port or sys.argv[2])' "$1" "$2"; }
answers() { (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; }

ensure_redis() {
  local host port; host=$(url_host "$REDIS_URL"); port=$(url_port "$REDIS_URL" 6379)
  if answers "$host" "$port"; then return; fi
  command -v redis-server >/dev/null || apt_install redis-server
  say "starting Redis on $host:$port (data in .run/redis, nothing persisted)"
  mkdir -p "$RUN_DIR/redis"
  redis-server --daemonize yes --bind "$host" --port "$port" --save "" --appendonly no \
    --dir "$RUN_DIR/redis" --logfile "$RUN_DIR/redis/redis.log" --pidfile "$RUN_DIR/redis/redis.pid"
  STARTED_REDIS="$RUN_DIR/redis/redis.pid"
  for _ in $(seq 50); do answers "$host" "$port" && return; sleep 0.1; done
  echo "Redis did not start; see .run/redis/redis.log" >&2; return 1
}

pg_bin() {
  local found
  found=$(command -v "$1" || ls -d /usr/lib/postgresql/*/bin/"$1" 2>/dev/null | sort -V | tail -n1)
  [ -n "$found" ] && echo "$found"
}

ensure_postgres() {
  local host port; host=$(url_host "$DATABASE_URL"); port=$(url_port "$DATABASE_URL" 5432)
  if answers "$host" "$port"; then return; fi
  if [ -z "$(pg_bin initdb)" ]; then
    apt_install postgresql
    # The Debian package may start a cluster of its own (password auth over TCP) on the
    # default port: stop it, so the project's own trust-auth cluster can take the port.
    if answers "$host" "$port" && command -v pg_ctlcluster >/dev/null; then
      for conf in /etc/postgresql/*/main; do
        [ -d "$conf" ] || continue
        as_root pg_ctlcluster --skip-systemctl-redirect "$(basename "$(dirname "$conf")")" main stop \
          || true
      done
    fi
  fi
  local data="$RUN_DIR/postgres" runas=()
  mkdir -p "$RUN_DIR"
  # PostgreSQL refuses to run as root: run it as the postgres user, in a directory it owns.
  if [ "$(id -u)" = 0 ]; then
    id postgres >/dev/null 2>&1 || useradd --system --no-create-home postgres
    runas=(runuser -u postgres --)
    # A checkout inside a private (0700) directory is out of the postgres user's reach:
    # keep the data directory in a place of the project's own that it can reach.
    if ! runuser -u postgres -- test -x "$RUN_DIR"; then
      data="/var/tmp/turnstile-postgres-$(printf '%s' "$ROOT" | md5sum | cut -c1-8)"
    fi
    mkdir -p "$data"; chown -R postgres: "$data"; chmod 700 "$data"
  else
    mkdir -p "$data"
  fi
  if [ ! -f "$data/PG_VERSION" ]; then
    say "initialising PostgreSQL in $data"
    (cd / && "${runas[@]}" "$(pg_bin initdb)" -D "$data" -U postgres --auth=trust -E UTF8 >/dev/null)
  fi
  say "starting PostgreSQL on $host:$port (data in $data)"
  (cd / && "${runas[@]}" "$(pg_bin pg_ctl)" -D "$data" -w -t 60 -l "$data/server.log" \
    -o "-p $port -k $data -c listen_addresses=$host" start >/dev/null)
  STARTED_POSTGRES="$data"
  STARTED_POSTGRES_AS=("${runas[@]}")
}

# Stop the Redis and PostgreSQL that ensure_redis / ensure_postgres started in this
# shell (never a server that was already answering). TURNSTILE_KEEP_STORES=1 keeps
# them and says how to stop them later.
stop_started_stores() {
  local redis_pid_file="${STARTED_REDIS:-}" pg_data="${STARTED_POSTGRES:-}"
  [ -n "$redis_pid_file$pg_data" ] || return 0
  if [ -n "${TURNSTILE_KEEP_STORES:-}" ]; then
    say "Redis and PostgreSQL started by ./scripts/up keep running (TURNSTILE_KEEP_STORES); stop them with:" || true
    [ -n "$redis_pid_file" ] && echo "    kill \$(cat $redis_pid_file)" >&2
    [ -n "$pg_data" ] && echo "    ${STARTED_POSTGRES_AS[*]} $(pg_bin pg_ctl) -D $pg_data stop" >&2
    return 0
  fi
  if [ -n "$redis_pid_file" ] && [ -f "$redis_pid_file" ]; then
    say "stopping the Redis ./scripts/up started" || true
    kill "$(cat "$redis_pid_file")" 2>/dev/null || true
  fi
  if [ -n "$pg_data" ]; then
    say "stopping the PostgreSQL ./scripts/up started" || true
    (cd / && "${STARTED_POSTGRES_AS[@]}" "$(pg_bin pg_ctl)" -D "$pg_data" -m fast -w stop >/dev/null) \
      || true
  fi
  return 0
}

# promtool and prometheus (Debian's prometheus package): the rules' unit tests and the
# dashboard test use them; the local stack runs a Prometheus when it is installed.
# A machine where the package cannot be installed still runs the suite: those tests skip.
ensure_prometheus() {
  if command -v promtool >/dev/null && command -v prometheus >/dev/null; then return; fi
  apt_install prometheus || say "could not install prometheus: the rules and dashboard tests will skip"
  # The package may start a service of its own on :9090; the stack runs its own.
  if command -v systemctl >/dev/null && systemctl is-active --quiet prometheus 2>/dev/null; then
    as_root systemctl stop prometheus || true
  fi
}

ensure_workspace() {
  ensure_uv
  say "syncing the uv workspace"
  # Bytecode up front: where PYTHONDONTWRITEBYTECODE is set, Python never caches it,
  # and every turnstilectl start would compile ~330 modules from source (~1 s of CPU).
  (cd "$ROOT" && uv sync --frozen --quiet --compile-bytecode)
  "$ROOT/.venv/bin/python" -m compileall -q -j 0 "$ROOT"/libs/*/src "$ROOT"/services/*/src \
    "$ROOT"/tools/*/src >/dev/null || true
}

# The Node client's packages (clients/typescript), exactly as package-lock.json pins
# them, where Node is installed: its test runs against the real stack from pytest
# (tests/clients) and is skipped only when there is no node. A failed install stops
# the run here rather than failing that test later.
ensure_node_client() {
  if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
    say "node/npm not found: the TypeScript client's test will skip"
    return
  fi
  say "installing the TypeScript client's packages (npm ci)"
  if ! (cd "$ROOT/clients/typescript" && npm ci --no-audit --no-fund --loglevel=error >/dev/null); then
    echo "npm ci failed in clients/typescript (is the npm registry reachable?);" \
      "fix it or uninstall node to skip the TypeScript client's test" >&2
    return 1
  fi
}

# PgBouncer (Debian's package): the tests of the substrate behind PgBouncer in transaction
# mode start their own from this binary (SPEC F7); they skip where it cannot be installed.
ensure_pgbouncer() {
  if command -v pgbouncer >/dev/null || [ -x /usr/sbin/pgbouncer ]; then return; fi
  apt_install pgbouncer || say "could not install pgbouncer: the PgBouncer tests will skip"
  # The package may start a service of its own on :6432; the tests run their own.
  if command -v systemctl >/dev/null && systemctl is-active --quiet pgbouncer 2>/dev/null; then
    as_root systemctl stop pgbouncer || true
  fi
}
