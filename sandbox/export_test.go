package sandbox

// RootCovered reports whether the sandbox's root is pending (not swapped in)
// and has its covers (overlay.Covers).
func (s *Sandbox) RootCovered() (pending, covered bool) {
	s.rootMu.RLock()
	defer s.rootMu.RUnlock()
	return s.root >= 0, s.covered.Load()
}
