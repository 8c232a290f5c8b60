-- Why a failed episode failed, in words (the API's Episode.failure_message): the verifier's
-- error, the infrastructure error of a step, "its sandbox died", and so on. Episodes recorded
-- before this migration have none.
ALTER TABLE episodes ADD COLUMN failure_message text;
