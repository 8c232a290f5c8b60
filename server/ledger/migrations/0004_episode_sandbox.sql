-- The sandbox an episode runs in, so that a server starting after a crash can end the episodes
-- its previous run left running (their sandboxes ended with it): failed, class infra, as a
-- graceful shutdown ends them. Episodes recorded before this migration have none.
ALTER TABLE episodes ADD COLUMN sandbox text;
CREATE INDEX episodes_running_sandbox_idx ON episodes (sandbox) WHERE status = 'running';
