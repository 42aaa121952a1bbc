-- depends: 0003_receipts
--
-- SPEC A2: activating_client_id is NULL, a reserved id, or a Kubernetes label
-- value of at most 63 characters.
--
-- Added NOT VALID: PostgreSQL checks every new or updated row from now on but
-- does not scan the rows already there, so the migration takes its ACCESS
-- EXCLUSIVE lock only for a catalog update, and succeeds over old rows that
-- violate the format. `ALTER TABLE sandboxes VALIDATE CONSTRAINT
-- sandboxes_activating_client_id_format` can check those later, under a weaker
-- lock, once they are cleaned up.
--
-- lock_timeout keeps the migration from queueing behind a long transaction and
-- blocking every reader behind itself; re-run it if it times out.
SET LOCAL lock_timeout = '5s';

DO $$
BEGIN
    ALTER TABLE sandboxes
        ADD CONSTRAINT sandboxes_activating_client_id_format CHECK (
            activating_client_id IS NULL
            OR activating_client_id IN ('native', 'unattributed', 'shared')
            OR (char_length(activating_client_id) <= 63
                AND activating_client_id ~ '^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$')
        ) NOT VALID;
EXCEPTION
    WHEN duplicate_object THEN NULL;  -- already there: re-running is a no-op
END
$$;
