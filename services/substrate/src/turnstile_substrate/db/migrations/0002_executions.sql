-- depends: 0001_sandboxes
--
-- Executions: each runtime a sandbox has had (a pod or a process), with the node
-- it ran on and the client label it carries. At most one is active (ended_at IS
-- NULL) per sandbox, enforced by the partial unique index below rather than by
-- the code that writes them.
CREATE TABLE IF NOT EXISTS executions (
    id           bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    sandbox_id   text        NOT NULL REFERENCES sandboxes (id) ON DELETE CASCADE,
    substrate    text        NOT NULL,
    kind         text        NOT NULL CHECK (kind IN ('cold', 'warm', 'restore', 'resume')),
    runtime_name text        NOT NULL,
    node         text        NOT NULL DEFAULT '',
    endpoint     text        NOT NULL DEFAULT '',
    client_label text        NULL CHECK (
        client_label IS NULL
        OR (char_length(client_label) <= 63
            AND client_label ~ '^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$')
    ),
    charged_key  text        NOT NULL DEFAULT '',
    started_at   timestamptz NOT NULL DEFAULT now(),
    ended_at     timestamptz NULL,
    end_reason   text        NULL
);

CREATE UNIQUE INDEX IF NOT EXISTS executions_one_active
    ON executions (sandbox_id) WHERE ended_at IS NULL;
CREATE INDEX IF NOT EXISTS executions_sandbox_started
    ON executions (sandbox_id, started_at DESC);
