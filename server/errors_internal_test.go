package server

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"testing"

	"connectrpc.com/connect"
	"google.golang.org/genproto/googleapis/rpc/errdetails"

	"github.com/deltagym/deltagym/envpool"
	"github.com/deltagym/deltagym/internal/errdefs"
	"github.com/deltagym/deltagym/sandbox"
	"github.com/deltagym/deltagym/server/episode"
	"github.com/deltagym/deltagym/server/ledger"
)

// Every error class has its code, and so has every sentinel of its class, wrapped or not.
func TestCodeOfClasses(t *testing.T) {
	want := map[error]connect.Code{
		errdefs.ErrInvalidArgument: connect.CodeInvalidArgument, errdefs.ErrNotFound: connect.CodeNotFound,
		errdefs.ErrAlreadyExists: connect.CodeAlreadyExists, errdefs.ErrFailedPrecondition: connect.CodeFailedPrecondition,
		errdefs.ErrResourceExhausted: connect.CodeResourceExhausted, errdefs.ErrAborted: connect.CodeAborted,
		errdefs.ErrUnavailable: connect.CodeUnavailable, errdefs.ErrUnauthenticated: connect.CodeUnauthenticated,
		errdefs.ErrInternal: connect.CodeInternal,
	}
	for _, class := range errdefs.Classes {
		code, ok := want[class]
		if !ok {
			t.Fatalf("class %v has no expected code in this test", class)
		}
		if got := codeOf(fmt.Errorf("doing x: %w", class)); got != code {
			t.Errorf("class %v: code %v, want %v", class, got, code)
		}
	}
	for _, sentinel := range []error{ErrInvalid, ErrNoLedger, ErrUnauthenticated, episode.ErrInvalid, episode.ErrEpisodeEnded,
		episode.ErrOtherEnv, ledger.ErrClosed, ledger.ErrInvalid, ledger.ErrNotFound, ledger.ErrSpoolLocked,
		ledger.ErrSpoolCorrupt, ledger.ErrUndelivered} {
		class := errdefs.Class(sentinel)
		if class == nil {
			t.Errorf("%v wraps no class", sentinel)
			continue
		}
		if got := codeOf(fmt.Errorf("doing x: %w", sentinel)); got != want[class] {
			t.Errorf("%v: code %v, want %v", sentinel, got, want[class])
		}
	}
}

// Errors of several classes, and of none.
func TestCodeOfPrecedence(t *testing.T) {
	for _, tc := range []struct {
		name string
		err  error
		want connect.Code
	}{
		{"an abort over what the call returned", fmt.Errorf("%w: %w", envpool.ErrAborted, episode.ErrEpisodeEnded), connect.CodeAborted},
		{"an abort over a closed sandbox", fmt.Errorf("%w: %w", envpool.ErrAborted, sandbox.ErrClosed), connect.CodeAborted},
		{"an env not ready for want of its image", causedBy{envpool.ErrNotReady, fmt.Errorf("image: %w", sandbox.ErrNotFound)},
			connect.CodeFailedPrecondition},
		{"an env not ready, its cause classed", causedBy{envpool.ErrNotReady, errdefs.ErrNotFound}, connect.CodeFailedPrecondition},
		{"an env waiting for capacity", causedBy{envpool.ErrWaiting, fmt.Errorf("creating setup sandbox: %w", sandbox.ErrCap)},
			connect.CodeResourceExhausted},
		{"unauthenticated over not found", fmt.Errorf("%w: %w", ErrUnauthenticated, sandbox.ErrNotFound), connect.CodeUnauthenticated},
		{"an abort over invalid", fmt.Errorf("%w: %w", errdefs.ErrAborted, sandbox.ErrInvalid), connect.CodeAborted},
		{"the class nearest the top", fmt.Errorf("%w: %w", errdefs.ErrInvalidArgument, fmt.Errorf("lookup: %w", errdefs.ErrNotFound)), connect.CodeInvalidArgument},
		{"deadline", fmt.Errorf("exec: %w", context.DeadlineExceeded), connect.CodeDeadlineExceeded},
		{"cancelled", fmt.Errorf("exec: %w", context.Canceled), connect.CodeCanceled},
		{"a connect error", connect.NewError(connect.CodeOutOfRange, errors.New("x")), connect.CodeOutOfRange},
		{"no class", errors.New("opening cgroup.procs: too many open files"), connect.CodeInternal},
	} {
		if got := codeOf(tc.err); got != tc.want {
			t.Errorf("%s (%v): %v, want %v", tc.name, tc.err, got, tc.want)
		}
	}
}

// An error of no class reaches the client as Internal without its text; a classed one without
// its class's words, which the code says.
func TestToConnect(t *testing.T) {
	s := &Server{log: slog.New(slog.NewTextHandler(io.Discard, nil)), scrubbers: [][2]string{{"/var/data", "$DATA"}}}
	err := s.toConnect(errors.New("opening /var/data/x: too many open files"))
	var ce *connect.Error
	if !errors.As(err, &ce) || ce.Code() != connect.CodeInternal || ce.Message() != "internal error (details in the server log)" {
		t.Fatalf("unclassified error: %v", err)
	}
	got := s.toConnect(fmt.Errorf("episode ep_1: %w", ledger.ErrNotFound))
	if !errors.As(got, &ce) || ce.Code() != connect.CodeNotFound || ce.Message() != "episode ep_1: not in the ledger" {
		t.Fatalf("classed error: %v", got)
	}
	got = s.toConnect(fmt.Errorf("%w: checkpoint %q in /var/data/c", sandbox.ErrNotFound, "ck"))
	if !errors.As(got, &ce) || ce.Code() != connect.CodeNotFound || ce.Message() != `checkpoint "ck" in $DATA/c` {
		t.Fatalf("runtime's error: %v", got)
	}
	got = s.toConnect(fmt.Errorf("env shell: checkpointing task: %w: the server's cap %q", sandbox.ErrCap, "checkpoints"))
	if !errors.As(got, &ce) || ce.Code() != connect.CodeResourceExhausted || ce.Message() != `env shell: checkpointing task: the server's cap "checkpoints"` {
		t.Fatalf("a cap's refusal: %v", got)
	}
	got = s.toConnect(causedBy{fmt.Errorf("env x: %w", envpool.ErrNotReady), fmt.Errorf("image %q: %w", "y", sandbox.ErrNotFound)})
	if !errors.As(got, &ce) || ce.Code() != connect.CodeFailedPrecondition || ce.Message() != `env x: env not ready: image "y": not found` {
		t.Fatalf("an env not ready: %v", got)
	}
}

// An error quoting a name that is not UTF-8 reaches the client with its message and its
// ErrorInfo's metadata valid (each such byte U+FFFD), and the error's own metadata unchanged.
func TestToConnectNotUTF8(t *testing.T) {
	s := &Server{log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	cause := errdefs.WithDetail(fmt.Errorf("reading /work/bad\xff\nname: %w", errdefs.ErrFailedPrecondition), "IS_A_DIRECTORY", "path", "/work/bad\xff\nname")
	var ce *connect.Error
	if !errors.As(s.toConnect(cause), &ce) || ce.Message() != "reading /work/bad\uFFFD\nname" {
		t.Fatalf("message: %v", ce)
	}
	if len(ce.Details()) != 1 {
		t.Fatalf("details: %v", ce.Details())
	}
	v, err := ce.Details()[0].Value()
	if err != nil {
		t.Fatal(err)
	}
	info, ok := v.(*errdetails.ErrorInfo)
	if !ok || info.GetReason() != "IS_A_DIRECTORY" || info.GetMetadata()["path"] != "/work/bad\uFFFD\nname" {
		t.Fatalf("detail: %v", v)
	}
	if errdefs.DetailOf(cause).Meta["path"] != "/work/bad\xff\nname" {
		t.Fatal("the error's own metadata changed")
	}
}

// causedBy is an error of its own kind with a cause, as envpool's not-ready errors are: it
// unwraps to itself first, then to the cause.
type causedBy struct{ own, cause error }

func (e causedBy) Error() string   { return e.own.Error() + ": " + e.cause.Error() }
func (e causedBy) Unwrap() []error { return []error{e.own, e.cause} }

// The reasons of the sentinels, first match first, with a reason an error carries before them;
// internal errors, Connect errors of the server's own and malformed requests have none.
func TestErrorReasonsTable(t *testing.T) {
	s := &Server{log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	ended := fmt.Errorf("sandbox s: %w", envpool.ErrLeaseEnded)
	for _, tc := range []struct {
		err  error
		want string
	}{
		{fmt.Errorf("env e: %w", envpool.ErrExhausted), "NO_CAPACITY"},
		{fmt.Errorf("fork: %w: the cap", sandbox.ErrCap), "NO_CAPACITY"},
		{fmt.Errorf("%w (%w)", episode.ErrEpisodeEnded, ended), "EPISODE_ENDED"},
		{ended, "SANDBOX_CLOSED"},
		{fmt.Errorf("env e: %w: %w", envpool.ErrNotReady, errdefs.WithDetail(sandbox.ErrNotFound, "IMAGE_NOT_FOUND", "image", "i")), "IMAGE_NOT_FOUND"},
		{fmt.Errorf("env e: %w", envpool.ErrNotReady), "ENV_NOT_READY"},
		{ErrNoLedger, "LEDGER_DISABLED"},
		{fmt.Errorf("no action: %w", ErrInvalid), ""},
		{errors.New("boom"), ""},
		{connect.NewError(connect.CodeResourceExhausted, errors.New("too big")), ""},
	} {
		if got := reasonOf(tc.err); got != tc.want {
			t.Errorf("reasonOf(%v) = %q, want %q", tc.err, got, tc.want)
		}
		var ce *connect.Error
		if !errors.As(s.toConnect(tc.err), &ce) {
			t.Fatalf("toConnect(%v) is no Connect error", tc.err)
		}
		if n := len(ce.Details()); (n == 1) != (tc.want != "") || n > 1 {
			t.Errorf("toConnect(%v) has %d details, want a reason %q", tc.err, n, tc.want)
		}
	}
}
