-- depends: 0002_executions
--
-- Receipts of the Direct substrate (SPEC S7): one per runtime started or
-- restored, carrying the activating client id (NULL when the activation
-- inherited a NULL record). Written in the same transaction as the execution.
CREATE TABLE IF NOT EXISTS receipts (
    id           bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    sandbox_id   text        NOT NULL REFERENCES sandboxes (id) ON DELETE CASCADE,
    execution_id bigint      NOT NULL REFERENCES executions (id) ON DELETE CASCADE,
    kind         text        NOT NULL CHECK (kind IN ('start', 'restore')),
    client_id    text        NULL,
    charged_key  text        NOT NULL DEFAULT '',
    runtime_name text        NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX IF NOT EXISTS receipts_sandbox_created ON receipts (sandbox_id, created_at DESC);
CREATE INDEX IF NOT EXISTS receipts_execution ON receipts (execution_id);
