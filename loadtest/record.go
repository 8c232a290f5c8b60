package loadtest

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"github.com/HdrHistogram/hdrhistogram-go"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Histograms record microseconds from 1 µs to 5 min with 3 significant digits.
const (
	histMin  = 1
	histMax  = int64(5 * time.Minute / time.Microsecond)
	histSigs = 3
)

func newHist() *hdrhistogram.Histogram { return hdrhistogram.New(histMin, histMax, histSigs) }

// recorder collects latencies per operation and errors by code, for what starts inside the
// measured window only.
type recorder struct {
	measureFrom time.Time // warm-up ends
	measureTo   time.Time // run ends

	mu sync.Mutex
	// +checklocks:mu
	hists map[string]*hdrhistogram.Histogram
	// +checklocks:mu
	errors map[string]int64
	// +checklocks:mu
	firstWrong string
	// +checklocks:mu
	timeline []Sample

	iterations atomic.Int64 // successful iterations in the window
	liveIters  atomic.Int64 // every successful iteration, for the progress line
	liveErrors atomic.Int64
}

func newRecorder() *recorder {
	return &recorder{hists: map[string]*hdrhistogram.Histogram{}, errors: map[string]int64{}}
}

func (r *recorder) inWindow(start time.Time) bool {
	return !start.Before(r.measureFrom) && start.Before(r.measureTo)
}

func (r *recorder) record(op string, start time.Time, d time.Duration) {
	if !r.inWindow(start) {
		return
	}
	us := max(d.Microseconds(), histMin)
	r.mu.Lock()
	h := r.hists[op]
	if h == nil {
		h = newHist()
		r.hists[op] = h
	}
	_ = h.RecordValue(min(us, histMax))
	r.mu.Unlock()
}

// fail counts err under "op: code" when start is in the window.
func (r *recorder) fail(op string, start time.Time, err error) {
	if !r.inWindow(start) || cutByEnd(err) && !time.Now().Add(endSlack).Before(r.measureTo) {
		// Outside the window, or a call the run's own end cut short.
		return
	}
	r.liveErrors.Add(1)
	r.mu.Lock()
	r.errors[op+": "+errCode(err)]++
	r.mu.Unlock()
}

// endSlack is how early before the run's end a deadline error may arrive and still be the run's
// end: the server's copy of the deadline (the grpc-timeout header) can fire a little before ours.
const endSlack = 100 * time.Millisecond

// cutByEnd reports whether err is a deadline or a cancellation, what a call in
// flight gets when the run ends.
func cutByEnd(err error) bool {
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
		return true
	}
	if s, ok := status.FromError(err); ok {
		return s.Code() == codes.DeadlineExceeded || s.Code() == codes.Canceled
	}
	return false
}

// errCode names an error: a gRPC code, or the load test's own verification failures.
func errCode(err error) string {
	switch {
	case errors.Is(err, ErrWrongRestore):
		return "wrong_restore"
	case errors.Is(err, ErrUnexpected):
		return "unexpected_response"
	}
	if s, ok := status.FromError(err); ok {
		return s.Code().String()
	}
	return "client_error"
}

// op times one call under name.
func (r *recorder) op(name string, f func() error) error {
	start := time.Now()
	err := f()
	if err != nil {
		return &opError{op: name, start: start, err: err}
	}
	r.record(name, start, time.Since(start))
	return nil
}

// opError carries the operation an iteration failed in.
type opError struct {
	op    string
	start time.Time
	err   error
}

func (e *opError) Error() string { return e.op + ": " + e.err.Error() }
func (e *opError) Unwrap() error { return e.err }

// noteWrong keeps the first wrong-restore message for the report.
func (r *recorder) noteWrong(err error) {
	r.mu.Lock()
	if r.firstWrong == "" {
		r.firstWrong = err.Error()
	}
	r.mu.Unlock()
}
