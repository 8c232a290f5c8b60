package ledger

import "io"

// CopyStepsStatement is the COPY statement the writer streams steps with.
const CopyStepsStatement = copySteps

// StepCopyStream is the binary COPY stream of rows that the writer hands pgconn.CopyFrom
// (stepCopier).
func StepCopyStream(rows []*StepRow) io.Reader { return &stepCopier{rows: rows} }
