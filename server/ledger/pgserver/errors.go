package pgserver

import "errors"

// Sentinel errors returned (wrapped) by this package.
var (
	// ErrNoBinaries means Config.BinDirs is empty, or one of its directories lacks initdb or
	// postgres.
	ErrNoBinaries = errors.New("postgres binaries not found (run `make postgres`)")
	// ErrVersion means the cluster was made by another major version than the binaries'.
	ErrVersion = errors.New("postgres major version mismatch")
	// ErrSocketPathTooLong means DataDir is too deep for a unix socket path (108 bytes on Linux).
	ErrSocketPathTooLong = errors.New("unix socket path too long")
	// ErrExited means the postmaster exited before it accepted connections.
	ErrExited = errors.New("postgres exited")
	// ErrStale means processes of an earlier postmaster of the cluster still run (its
	// backends, after it was killed outright), so a new one cannot start yet.
	ErrStale = errors.New("old postgres processes still running")
	// ErrStopped means the server is not running.
	ErrStopped = errors.New("postgres server stopped")
)
