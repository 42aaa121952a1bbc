ALTER TABLE sandboxes DROP CONSTRAINT IF EXISTS sandboxes_activating_client_id_format;
