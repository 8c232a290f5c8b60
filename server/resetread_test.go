package server_test

import (
	"testing"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/server"
)

// A file action right after Reset resolves as in any other state. Resets of a cached task
// fork a fresh sandbox, whose root was just swapped in: the skeleton root it replaced sits on
// the new root's "/" until it is detached, and a path that steps onto "/" by ".." must not
// meet it (RESOLVE_NO_XDEV would refuse it as leaving the sandbox's filesystem).
func TestReadFileRightAfterReset(t *testing.T) {
	b := setup(t, func(c *server.Config) { c.NoLedger = true })
	for i := range 60 {
		rr, err := b.grpc.Reset(t.Context(), &deltagymv1.ResetRequest{Env: "task"})
		must(t, err)
		st, err := b.grpc.Step(t.Context(), &deltagymv1.StepRequest{SandboxId: rr.GetSandboxId(), Action: readFileAction("/tmp/../tmp/base")})
		if err != nil || string(st.GetObservation().GetReadFile().GetContent()) != "base\n" {
			t.Fatalf("reset %d: read_file /tmp/../tmp/base: %v, observation %v", i, err, st.GetObservation())
		}
		_, err = b.grpc.Close(t.Context(), &deltagymv1.CloseRequest{SandboxId: rr.GetSandboxId()})
		must(t, err)
	}
}
