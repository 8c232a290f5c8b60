package envpool

// WaitReaps waits for the reaps the reaper's sweeps started: tests call it while the reaper waits
// for its next round, so that no sweep starts one meanwhile.
func (m *Manager) WaitReaps() { m.reaping.Wait() }
