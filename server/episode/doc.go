// Package episode is the episode core: the rules of deltagym's episodes, which every protocol
// front end (the Connect and gRPC handlers of package server, and any other) drives through one
// Go API in domain types.
//
// Vocabulary. A Core keeps, for each sandbox it handed out (Reset, Fork), the sandbox's lease
// and its current episode: its id, run and group, the checkpoint it started from, the steps it
// inherited from that checkpoint (base) and its own, its reward so far, when it started and
// whether and how it ended. Step indices count from the start of the path: an episode that
// starts at a checkpoint taken after k steps numbers its first step k.
//
// Lifecycle. Reset and Fork start episodes (Fork one per child). Step performs one action
// (exec, write_file, read_file, submit): a submit runs the verifier and terminates the episode;
// the env's budgets (max_steps, max_seconds) truncate it; an infrastructure failure ends it
// failed. Restore, and a step with a restore, end the running episode as branched and start
// the next one at the checkpoint. Close truncates a running episode; a lease that expires
// does too, and one whose sandbox died fails it (LeaseEnded, the pools' hook). Every start,
// step, reward, checkpoint and end is recorded in the ledger when there is one. Reset and Fork
// with an idempotency key return the first call's result to a retry.
//
// Checkpoints carry where they were taken (Place) as labels in their own record
// (sandbox.CheckpointOptions.Labels): it holds without a ledger and across restarts, and goes
// with the checkpoint. The ledger's checkpoint rows mirror it.
//
// Calls on one sandbox run one at a time (envpool.Lease.Begin), except that Restore and Close
// abort a call in progress. Locks: Core.mu guards the map of sandboxes, a sandbox's mu its
// episode; neither is held while the other is taken, nor across a call to the runtime, the
// pools or the ledger. The idempotency caches and the set of ended sandboxes have locks of
// their own, taken alone.
package episode
