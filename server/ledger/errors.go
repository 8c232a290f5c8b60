package ledger

import "errors"

// Sentinel errors returned (wrapped) by this package.
var (
	// ErrClosed means the writer was closed; the row was not recorded.
	ErrClosed = errors.New("ledger writer closed")
	// ErrInvalid means a row or query argument is malformed (bad status, kind, action JSON…).
	ErrInvalid = errors.New("invalid ledger input")
	// ErrNotFound means the episode (or checkpoint) is not in the ledger.
	ErrNotFound = errors.New("not found in ledger")
	// ErrSpoolLocked means another writer holds the spool directory.
	ErrSpoolLocked = errors.New("spool directory in use by another writer")
	// ErrSpoolCorrupt means a sealed spool segment failed its checksum (a torn tail of the
	// newest segment is expected after a crash and is cut off instead).
	ErrSpoolCorrupt = errors.New("spool segment corrupt")
	// ErrUndelivered means Close or Flush ended before every row reached Postgres; the rest stay
	// in the spool and are delivered by the next writer on the same directory.
	ErrUndelivered = errors.New("rows left undelivered in the spool")
)
