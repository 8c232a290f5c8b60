package episode

import (
	"context"
	"fmt"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
	"golang.org/x/sys/unix"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/envpool"
	"github.com/deltagym/deltagym/sandbox"
)

// The process actions: list_processes and signal.

// validateSignal checks a signal action: a pid of the sandbox other than its init, and a
// signal number. Whether a process has that pid is the sandbox's state (an agent's error).
func validateSignal(x Signal) error {
	switch {
	case x.Pid == 1:
		return fmt.Errorf("signal: pid 1 is the sandbox's init, which cannot be signalled: %w", ErrInvalid)
	case x.Pid <= 0:
		return fmt.Errorf("signal: pid %d is not a process of the sandbox (a positive pid, from list_processes or a background exec): %w", x.Pid, ErrInvalid)
	case x.Signal < 0 || x.Signal > sandbox.MaxSignal:
		return fmt.Errorf("signal: %d is not a signal number (1 to %d; 0 means SIGTERM): %w", x.Signal, sandbox.MaxSignal, ErrInvalid)
	}
	return nil
}

// processAction performs a list_processes or a signal action.
func (c *Core) processAction(ctx context.Context, l *envpool.Lease, a Action, attrs []attribute.KeyValue) (outcome, error) {
	ctx, done := c.cfg.Observe(ctx, a.Kind())
	trace.SpanFromContext(ctx).SetAttributes(attrs...)
	var o Observation
	var err error
	switch x := a.(type) {
	case ListProcesses:
		var ps []sandbox.Process
		if ps, err = l.Sandbox().ListProcesses(ctx); err == nil {
			o.ListProcesses = &ListProcessesResult{Processes: ps}
		}
	case Signal:
		if err = l.Sandbox().Signal(ctx, x.Pid, unix.Signal(x.Signal), x.Group); err == nil {
			o.Signal = &SignalResult{}
		}
	}
	done(err)
	if err != nil {
		return outcome{}, err
	}
	return outcome{obs: o}, nil
}

// processActionProto is a process action's API form.
func processActionProto(a Action) *deltagymv1.Action {
	switch x := a.(type) {
	case ListProcesses:
		return &deltagymv1.Action{Kind: &deltagymv1.Action_ListProcesses{ListProcesses: &deltagymv1.ListProcessesAction{}}}
	case Signal:
		return &deltagymv1.Action{Kind: &deltagymv1.Action_Signal{Signal: &deltagymv1.SignalAction{Pid: int32(x.Pid),
			Signal: int32(x.Signal), ProcessGroup: x.Group}}}
	}
	return nil
}

// processObservationProto is the API form of a process action's observation.
func processObservationProto(o Observation) *deltagymv1.Observation {
	if o.Signal != nil {
		return &deltagymv1.Observation{Kind: &deltagymv1.Observation_Signal{Signal: &deltagymv1.SignalResult{}}}
	}
	r := &deltagymv1.ListProcessesResult{}
	for _, p := range o.ListProcesses.Processes {
		r.Processes = append(r.Processes, &deltagymv1.ProcessInfo{Pid: int32(p.Pid), Ppid: int32(p.PPid), Pgid: int32(p.Pgid),
			Sid: int32(p.Sid), Argv: p.Argv, State: p.State, Session: p.Session, StartSeconds: p.Age.Seconds()})
	}
	return &deltagymv1.Observation{Kind: &deltagymv1.Observation_ListProcesses{ListProcesses: r}}
}
