package sandbox

import "github.com/deltagym/deltagym/sandbox/procstate"

// Folding is how many processes (templates and live processes) wait to be,
// or are being, folded into huge pages.
func (r *Runtime) Folding() int { return r.folds.Busy() }

// memoryRoom is how many more bytes the sandbox's processes may take in
// huge pages: what keeps it under three quarters of its memory limit, and
// the machine with a quarter of its memory available.
func (s *Sandbox) memoryRoom() int64 {
	room := procstate.HostRoom()
	if lim := s.spec.Limits.MemoryBytes; lim > 0 {
		st, err := s.cg.Stats()
		if err != nil {
			return 0
		}
		room = min(room, lim*3/4-st.MemoryBytes)
	}
	return room
}
