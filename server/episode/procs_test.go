package episode

import (
	"errors"
	"regexp"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/sandbox"
)

// The caller's mistakes in a process action or an interactive exec are refused before anything
// runs (and before the restore of a step that carries one).
func TestValidateProcessAndInteractActions(t *testing.T) {
	big := regexp.MustCompile(strings.Repeat("a", sandbox.MaxExpectBytes+1))
	many := make([]*regexp.Regexp, sandbox.MaxExpect+1)
	for i := range many {
		many[i] = regexp.MustCompile("x")
	}
	for _, tc := range []struct {
		name string
		a    Action
		ok   bool
	}{
		{"list", ListProcesses{}, true},
		{"signal", Signal{Pid: 2, Signal: 9}, true},
		{"signal 0", Signal{Pid: 2}, true},
		{"group", Signal{Pid: 7, Signal: 64, Group: true}, true},
		{"init", Signal{Pid: 1, Signal: 9}, false},
		{"init's group", Signal{Pid: 1, Group: true}, false},
		{"pid 0", Signal{Pid: 0}, false},
		{"negative pid", Signal{Pid: -2, Signal: 9}, false},
		{"signal past 64", Signal{Pid: 2, Signal: 65}, false},
		{"negative signal", Signal{Pid: 2, Signal: -1}, false},
		{"interactive", Exec{Command: "python3", Session: "s", Interact: &sandbox.Interact{Expect: []*regexp.Regexp{regexp.MustCompile(">>> ")}}}, true},
		{"enter key", Exec{Session: "s", Interact: &sandbox.Interact{}}, true},
		{"interactive without session", Exec{Command: "x", Interact: &sandbox.Interact{}}, false},
		{"too many patterns", Exec{Command: "x", Session: "s", Interact: &sandbox.Interact{Expect: many}}, false},
		{"pattern too large", Exec{Command: "x", Session: "s", Interact: &sandbox.Interact{Expect: []*regexp.Regexp{big}}}, false},
		{"pattern matching nothing", Exec{Command: "x", Session: "s", Interact: &sandbox.Interact{Expect: []*regexp.Regexp{regexp.MustCompile("a*")}}}, false},
	} {
		err := validate(tc.a)
		if tc.ok != (err == nil) || err != nil && !errors.Is(err, ErrInvalid) && !errors.Is(err, sandbox.ErrInvalid) {
			t.Errorf("%s: %v", tc.name, err)
		}
	}
}

// The ledger's JSON of a process action reads back as the action; an exec's observation keeps
// matched and running; a process list's, its processes.
func TestProcessActionsRecorded(t *testing.T) {
	for _, a := range []Action{ListProcesses{}, Signal{Pid: 12, Signal: 2, Group: true}, Signal{Pid: 3}} {
		b, err := recordedAction(a)
		if err != nil {
			t.Fatal(err)
		}
		var back deltagymv1.Action
		if err := protojson.Unmarshal(b, &back); err != nil || !proto.Equal(&back, actionProto(a)) || back.GetKind() == nil {
			t.Fatalf("%#v recorded as %s, read back as %v (%v)", a, b, &back, err)
		}
	}
	o := ObservationProto(Observation{Exec: &sandbox.ExecResult{Stdout: []byte(">>> "), Matched: ">>> ", Running: true}})
	if x := o.GetExec(); x.GetMatched() != ">>> " || !x.GetRunning() {
		t.Fatalf("exec observation: %v", o)
	}
	o = ObservationProto(Observation{ListProcesses: &ListProcessesResult{Processes: []sandbox.Process{
		{Pid: 5, PPid: 1, Pgid: 5, Sid: 5, Argv: []string{"sleep", "9"}, State: "S", Session: "main", Age: 1500 * time.Millisecond}}}})
	ps := o.GetListProcesses().GetProcesses()
	if len(ps) != 1 || ps[0].GetPid() != 5 || ps[0].GetSession() != "main" || ps[0].GetStartSeconds() != 1.5 || ps[0].GetArgv()[1] != "9" {
		t.Fatalf("list observation: %v", o)
	}
	if o := ObservationProto(Observation{Signal: &SignalResult{}}); o.GetSignal() == nil {
		t.Fatalf("signal observation: %v", o)
	}
}
