package ledger

import (
	"fmt"

	"github.com/deltagym/deltagym/internal/errdefs"
)

// Sentinel errors returned (wrapped) by this package, each of an errdefs class.
var (
	// ErrClosed means the writer was closed; the row was not recorded.
	ErrClosed = fmt.Errorf("ledger writer closed: %w", errdefs.ErrUnavailable)
	// ErrInvalid means a row or query argument is malformed (bad status, kind, action JSON…).
	ErrInvalid = fmt.Errorf("invalid ledger input: %w", errdefs.ErrInvalidArgument)
	// ErrNotFound means the episode (or checkpoint) is not in the ledger.
	ErrNotFound = fmt.Errorf("not in the ledger: %w", errdefs.ErrNotFound)
	// ErrSpoolLocked means another writer holds the spool directory.
	ErrSpoolLocked = fmt.Errorf("spool directory in use by another writer: %w", errdefs.ErrFailedPrecondition)
	// ErrSpoolCorrupt means a sealed spool segment failed its checksum (a torn tail of the
	// newest segment is expected after a crash and is cut off instead).
	ErrSpoolCorrupt = fmt.Errorf("spool segment corrupt: %w", errdefs.ErrInternal)
	// ErrSpoolWrite means a write to the spool failed (a full or failing disk): the rows are
	// not stored yet. They stay buffered and later writes retry them.
	ErrSpoolWrite = fmt.Errorf("writing the ledger spool: %w", errdefs.ErrUnavailable)
	// ErrUndelivered means Close or Flush ended before every row reached Postgres; the rest stay
	// in the spool and are delivered by the next writer on the same directory.
	ErrUndelivered = fmt.Errorf("rows left undelivered in the spool: %w", errdefs.ErrUnavailable)
)
