// Package envpool keeps deltagym's env catalog and, for each env, a pool of warm sandboxes.
//
// The catalog is loaded from a directory of spec files (one EnvSpec each, in its protobuf JSON
// form, *.json) and can grow while the server runs
// (Register). For each env the Manager runs the env's setup commands once in a sandbox created
// from its image and checkpoints the result: the env's initial (pool) checkpoint. A populate
// goroutine per env then keeps a buffered channel of warm sandboxes filled by forking that
// checkpoint, so that Acquire is a hand-over, not a boot.
//
// Reset adds tasks: an env's reset hook runs with the seed and options as environment variables;
// its stdout is the initial observation and the state after it is checkpointed (a task
// checkpoint) and cached by (env, seed, options), so that the next reset of the same task is a
// fork of that checkpoint instead of a rerun of the hook.
//
// Sandboxes handed out are leased: each Lease has a TTL renewed by every call (Begin) and by
// Touch, and a reaper goroutine closes the sandboxes whose lease expired while no call was in
// flight, each on a goroutine of its own, at least once a second. Reaping never releases
// checkpoints. The Manager knows nothing of the RPC server: it
// reports checkpoints it takes and sandboxes it reaps through callbacks in its Config.
//
// The Manager reaches sandboxes through two small interfaces of its own: Backend (a runtime that
// creates sandboxes, forks checkpoints and releases them) and Box (one sandbox: exec,
// checkpoint, close, destroy), and time through a Clock (lease expiry, the reaper, acquire deadlines,
// refill back-off). The sandbox runtime and the system's clock are the defaults; package
// envpooltest has fakes of them, and the package's tests run one suite against the fake and the
// real runtime alike.
//
// An env whose setup a cap of the server refuses (errdefs.ErrResourceExhausted) waits for
// capacity rather than failing: Reset is refused with ErrWaiting, and setup runs again after a
// back-off, or as soon as a sandbox the Manager closed or destroyed is torn down.
//
// Lock order: Manager.mu, then a Lease's or a task cache's mu; a pool's mu is taken alone. None
// is held while a Backend or Box is called or while the Config's callbacks run.
package envpool
