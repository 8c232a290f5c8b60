package deltagym_test

import (
	"bytes"
	"testing"

	"connectrpc.com/connect"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
)

// StreamStep hands an exec's output over as it comes, then returns the step's response, whose
// output the pieces begin with; through each protocol.
func TestStreamStep(t *testing.T) {
	needServer(t)
	for _, p := range protocols {
		t.Run(p.name, func(t *testing.T) {
			sb := reset(t, dial(t, p.opts...))
			var out, errs bytes.Buffer
			pieces := 0
			resp, err := sb.StreamStep(t.Context(), &deltagymv1.Action{Kind: &deltagymv1.Action_Exec{Exec: &deltagymv1.ExecAction{
				Command: "echo one; echo two >&2; echo three"}}}, false, func(stream deltagymv1.OutputStream, data []byte) {
				pieces++
				if stream == deltagymv1.OutputStream_OUTPUT_STREAM_STDERR {
					errs.Write(data)
				} else {
					out.Write(data)
				}
			})
			if err != nil {
				t.Fatal(err)
			}
			x := resp.GetObservation().GetExec()
			if string(x.GetStdout()) != "one\nthree\n" || out.String() != string(x.GetStdout()) || errs.String() != "two\n" || pieces < 2 {
				t.Fatalf("streamed %q and %q in %d pieces, response %v", out.String(), errs.String(), pieces, resp)
			}
			if resp.GetEpisodeId() != sb.EpisodeID() {
				t.Fatalf("episode %s, handle's %s", resp.GetEpisodeId(), sb.EpisodeID())
			}
			// An error is the step's.
			_, err = sb.StreamStep(t.Context(), &deltagymv1.Action{}, false, nil)
			if connect.CodeOf(err) != connect.CodeInvalidArgument {
				t.Fatalf("an action of no kind: %v", err)
			}
		})
	}
}
