-- Sandbox records: one row per sandbox the substrate has ever run.
--
-- activating_client_id (SPEC A1) is the client id whose activation last created
-- the sandbox's runtime, the same value as the runtime's client label; NULL when
-- that activation inherited from a sandbox with no recorded client (A4). Its
-- format CHECK is added NOT VALID by 0004, so that migration never scans.
CREATE TABLE IF NOT EXISTS sandboxes (
    id                   text        PRIMARY KEY,
    tier                 text        NOT NULL DEFAULT '',
    state                text        NOT NULL CHECK (state IN ('running', 'stopped')),
    substrate            text        NOT NULL,
    activating_client_id text        NULL,
    created_at           timestamptz NOT NULL DEFAULT now(),
    updated_at           timestamptz NOT NULL DEFAULT now()
);

-- ListSandboxes pages newest first, optionally for one client.
CREATE INDEX IF NOT EXISTS sandboxes_newest ON sandboxes (created_at DESC, id DESC);
CREATE INDEX IF NOT EXISTS sandboxes_client_newest
    ON sandboxes (activating_client_id, created_at DESC, id DESC);
