package loadtest

import (
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"github.com/HdrHistogram/hdrhistogram-go"
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

	mu         sync.Mutex
	hists      map[string]*hdrhistogram.Histogram
	errors     map[string]int64
	firstWrong string
	timeline   []Sample

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
	r.liveErrors.Add(1)
	if !r.inWindow(start) {
		return
	}
	r.mu.Lock()
	r.errors[op+": "+errCode(err)]++
	r.mu.Unlock()
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
