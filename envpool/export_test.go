package envpool

// WaitReaps waits for the reaps the reaper's sweeps started: tests call it while the reaper waits
// for its next round, so that no sweep starts one meanwhile.
func (m *Manager) WaitReaps() { m.reaping.Wait() }

// Settled is closed once the env's setup is over: ready or broken.
func (e *Env) Settled() <-chan struct{} { return e.pool.ready }

// Refused is closed once the env's setup was refused for capacity.
func (e *Env) Refused() <-chan struct{} { return e.pool.refused }

// CapacityRetryMin is the first back-off of a setup waiting for capacity.
const CapacityRetryMin = capacityRetryMin
