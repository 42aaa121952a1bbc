-- depends: 0004_sandboxes_client_check
--
-- Activation claims: one activation (or deactivation) of a sandbox at a time,
-- across every replica, without holding a database session for it (SPEC F5, F7).
--
-- A row says "owner is activating sandbox_id until expires_at". It is taken by one
-- short statement (insert, or overwrite a row whose expiry has passed), renewed
-- while the activation runs, checked under a row lock by the activation's final
-- transaction (fencing: a claim taken over by another owner refuses the write) and
-- deleted at the end. An owner that dies leaves its row to expire; the next claim
-- of the sandbox overwrites it. Expiry is compared with the database's clock only,
-- so replicas' clocks never meet.
--
-- No foreign key: a new sandbox is claimed before it has a row in sandboxes.
CREATE TABLE IF NOT EXISTS activation_claims (
    sandbox_id text        PRIMARY KEY,
    owner      text        NOT NULL,
    claimed_at timestamptz NOT NULL DEFAULT now(),
    expires_at timestamptz NOT NULL
);

-- Finding the claims left by dead owners (operators, and the sweep of stale rows).
CREATE INDEX IF NOT EXISTS activation_claims_expires ON activation_claims (expires_at);
