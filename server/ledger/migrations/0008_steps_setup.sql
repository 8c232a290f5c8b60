-- A step that set the task up rather than one the agent took (the API's StepRequest.setup):
-- recorded like any step, numbered among them, and counted against neither of the env's
-- budgets. Steps recorded before this migration are the agent's.
ALTER TABLE steps ADD COLUMN setup boolean NOT NULL DEFAULT false;
