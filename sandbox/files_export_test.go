package sandbox

// SetFileRaceHook makes f run where a tree action's walk has checked a name of the directory
// dir and is about to open it, until the returned function is called. Not for parallel tests.
func SetFileRaceHook(f func(dir int, name string)) (reset func()) {
	raceHook = f
	return func() { raceHook = nil }
}
